"""Reading answers: replay markers, Retry-After, problem types, how two bodies differ."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from email.utils import parsedate_to_datetime

from .report import Exchange

#: Headers another implementation might mark a replay with, shown (never judged) when the
#: configured marker is missing.
_MARKER_HINTS = ("replay", "idempot")


def is_marked(exchange: Exchange, marker: tuple[str, str] | None) -> bool | None:
    """Whether the answer carries the replay marker; None when no marker is checked."""
    if marker is None:
        return None
    value = exchange.header(marker[0])
    return value is not None and value.strip().lower() == marker[1].lower()


def marker_candidates(exchange: Exchange) -> list[str]:
    return [
        f"{name}: {value}"
        for name, value in exchange.headers
        if any(hint in name.lower() for hint in _MARKER_HINTS)
    ]


def valid_retry_after(value: str | None) -> bool:
    """RFC 9110: delay-seconds (digits) or an HTTP-date."""
    if value is None:
        return False
    value = value.strip()
    if value.isascii() and value.isdigit():
        return True
    try:
        parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return False
    return True


def problem_type(exchange: Exchange) -> str | None:
    """The `type` of an application/problem+json answer, for the evidence only: the draft
    leaves problem types to each server, so no verdict depends on one."""
    if "problem+json" not in (exchange.header("content-type") or ""):
        return None
    try:
        document = json.loads(exchange.body)
    except ValueError:
        return None
    kind = document.get("type") if isinstance(document, dict) else None
    return kind if isinstance(kind, str) else None


def with_problem(exchange: Exchange) -> str:
    """`422 (problem type urn:…)` or `422`."""
    kind = problem_type(exchange)
    shown = "no answer" if exchange.status is None else str(exchange.status)
    return f"{shown} (problem type {kind})" if kind else shown


def difference(first: Exchange, second: Exchange) -> str:
    """How two answers differ, in a phrase: the status, or where the bodies part."""
    if first.status != second.status:
        return f"status {second.status}, not {first.status}"
    a, b = first.body, second.body
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"bodies part at byte {at} of {len(a)}/{len(b)}: {_snippet(a, at)} vs {_snippet(b, at)}"


def _snippet(body: bytes, at: int) -> str:
    return repr(body[max(0, at - 12) : at + 28].decode("utf-8", "replace"))


def tally(exchanges: Iterable[Exchange]) -> str:
    """`201 x1, 409 x9`"""
    counts = Counter(
        "error" if exchange.status is None else str(exchange.status) for exchange in exchanges
    )
    return ", ".join(f"{status} x{count}" for status, count in sorted(counts.items()))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
