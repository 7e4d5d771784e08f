"""RFC 9457 problem answers the middleware gives. The `type` values are stable: clients may
branch on them. Each `detail` tells the caller what to do next. Each body also carries a
`code` member: the word that the IETF Idempotency-Key draft's implementations use for the same
problem (`fingerprint-mismatch` for `key-reused`, see `PROFILE_CODES`), or the type's own name
where they have none, so that a client written against them reads these answers too.

The documentation's "HTTP contract" page lists every type with its status, code and meaning."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import Send

TYPE_PREFIX = "urn:idempotency-asgi:problem:"
"""Every problem's `type` is this and its name: `urn:idempotency-asgi:problem:key-reused`."""
MEDIA_TYPE = b"application/problem+json"
"""The `Content-Type` of every problem answer."""

PROFILE_CODES = {
    "key-reused": "fingerprint-mismatch",
    "request-in-progress": "conflict",
    "body-too-large": "payload-too-large",
}
"""The `code` of the problems that the draft's implementations name otherwise (anyonce's
conformance profile: `missing-key`, `invalid-key`, `conflict`, `fingerprint-mismatch`,
`payload-too-large`, `store-unavailable`); every other problem's `code` is its name."""


@dataclass(frozen=True)
class Problem:
    """One problem answer: its status, its name (the end of its `type`), a `title` and a
    `detail`, and maybe a `Retry-After`, more members (`extra`) and headers of its own."""

    status: int
    name: str
    title: str
    detail: str
    retry_after: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def type(self) -> str:
        """`urn:idempotency-asgi:problem:<name>`."""
        return TYPE_PREFIX + self.name

    @property
    def code(self) -> str:
        """The body's `code` member: the name the draft's implementations give this problem
        (`PROFILE_CODES`), or its own."""
        return PROFILE_CODES.get(self.name, self.name)

    def render(self) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The answer's headers and its JSON body."""
        body = orjson.dumps(
            {
                "type": self.type,
                "code": self.code,
                "title": self.title,
                "status": self.status,
                "detail": self.detail,
                **self.extra,
            }
        )
        headers = [(b"content-type", MEDIA_TYPE), (b"content-length", str(len(body)).encode())]
        if self.retry_after is not None:
            seconds = max(1, math.ceil(self.retry_after))
            headers.append((b"retry-after", str(seconds).encode()))
        headers.extend(self.headers)
        return headers, body

    async def send(self, send: Send) -> None:
        """Send the whole answer on an ASGI `send`."""
        headers, body = self.render()
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def missing_key() -> Problem:
    return Problem(
        400,
        "missing-key",
        "Idempotency-Key required",
        "This request changes state and must carry an Idempotency-Key header: "
        "a unique value (a UUID is a good choice) reused for every retry of it.",
    )


def invalid_key(reason: str) -> Problem:
    return Problem(
        400,
        "invalid-key",
        "Invalid Idempotency-Key",
        f"{reason} Send one key of 1 to 255 visible ASCII characters.",
    )


def unauthenticated(challenge: str | None = None) -> Problem:
    """`challenge`: the WWW-Authenticate value (`Bearer`, say), when the application has one."""
    return Problem(
        401,
        "unauthenticated",
        "Authentication required",
        "Keyed requests are scoped to the caller's account; authenticate and retry.",
        headers=() if challenge is None else ((b"www-authenticate", challenge.encode("latin-1")),),
    )


def tenant_resolver_failed() -> Problem:
    """The application's `tenant(scope)` raised, or returned neither a str nor None: a fault
    of the service, not of the caller, and no guess is made at who is asking."""
    return Problem(
        500,
        "tenant-resolver-failed",
        "The caller's account could not be determined",
        "The service failed to tell who is asking (its tenant resolver failed), so the "
        "request was not processed. Retrying with the same key is safe; operators have the "
        "error in their logs.",
    )


def body_too_large(limit: int) -> Problem:
    return Problem(
        413,
        "body-too-large",
        "Request body too large",
        f"The request body exceeds {limit} bytes; nothing was processed.",
        extra={"limit": limit},
    )


def key_mismatch() -> Problem:
    return Problem(
        422,
        "key-reused",
        "Idempotency-Key reused for a different request",
        "This key was already used with a different method, path, query or body. "
        "Use a new key for a new request; nothing was processed.",
    )


def in_flight(retry_after: float) -> Problem:
    return Problem(
        409,
        "request-in-progress",
        "A request with this key is in progress",
        "The first request with this key has not finished. Retry after the number "
        "of seconds in Retry-After to receive its result.",
        retry_after=retry_after,
    )


def lease_lost() -> Problem:
    return Problem(
        409,
        "lease-lost",
        "The request was taken over",
        "This request ran longer than its lease and another attempt with the same "
        "key took it over; this attempt's changes were rolled back. Retry to "
        "receive the result of the attempt that holds the key.",
        retry_after=1,
    )


def not_replayable(status: int) -> Problem:
    return Problem(
        409,
        "response-not-replayable",
        "The response cannot be replayed",
        f"A request with this key already completed with status {status}, but its "
        "response was not stored for replay: it was too large to store (or, through the "
        "gateway, its end could not be told from a cut). It will not run again; look its "
        "result up through the API.",
        extra={"original_status": status},
    )


def too_many_in_flight(limit: int | None) -> Problem:
    return Problem(
        429,
        "too-many-in-flight",
        "Too many requests in progress",
        f"This account already has {limit} keyed requests in progress. Retry this request, "
        "with the same key, after Retry-After seconds.",
        retry_after=1,
    )


def too_many_keys(limit: int | None) -> Problem:
    return Problem(
        429,
        "too-many-keys",
        "Too many idempotency keys stored",
        f"This account already stores {limit} idempotency keys, and a new one is only "
        "accepted once older ones pass their retention. Nothing was processed; retry this "
        "request, with the same key, later.",
    )


def outcome_unknown(retry_after: float) -> Problem:
    return Problem(
        504,
        "outcome-unknown",
        "The outcome of the request is unknown",
        "The request was started but it cannot be known whether it took effect. The key "
        "stays reserved; retry with the same key after Retry-After seconds to receive its "
        "result, or to run it again if it never finished.",
        retry_after=retry_after,
    )


def transaction_failed() -> Problem:
    return Problem(
        500,
        "transaction-failed",
        "The request's changes could not be saved",
        "The request's database transaction failed, so the success the application reported "
        "did not happen; all of its changes were rolled back and nothing was kept. Retrying "
        "with the same key runs the request again.",
    )


def transaction_ended() -> Problem:
    return Problem(
        500,
        "transaction-ended-by-handler",
        "The handler ended the request's transaction",
        "The application committed or rolled back the request's database transaction itself, "
        "so its changes could not be saved together with the answer, and may or may not have "
        "been kept. This is a bug in the application: the request's transaction must be left "
        "to the middleware. The key stays reserved until its lease lapses.",
    )


def transaction_idle(seconds: float) -> Problem:
    return Problem(
        500,
        "transaction-idle",
        "The request waited on its own transaction",
        f"Another database session waited {seconds:g} s on the request's transaction while "
        "that transaction sat idle, so its statement was cancelled and the request failed. "
        "The usual cause is a second session of the application's own that writes a row this "
        "request's transaction holds: use the request's session for every write of the "
        "request. What the request wrote through its transaction was not kept; the key stays "
        "reserved until its lease lapses, since a write made elsewhere may have been.",
    )


def transaction_conflict(retry_after: float) -> Problem:
    return Problem(
        503,
        "transaction-conflict",
        "The request conflicted with a concurrent one",
        "The request's database transaction conflicted with a concurrent one and was rolled "
        "back; nothing was processed. Retry with the same key after Retry-After seconds.",
        retry_after=retry_after,
    )


def store_unavailable(retry_after: float) -> Problem:
    return Problem(
        503,
        "store-unavailable",
        "Idempotency store unavailable",
        "The request could not be made safe to retry right now, so it was not "
        "processed (or its changes were rolled back). Retry with the same key "
        "after Retry-After seconds.",
        retry_after=retry_after,
    )


def store_refused(error: str) -> Problem:
    """`error`: what PostgreSQL said, as its class and SQLSTATE (never the statement)."""
    return Problem(
        500,
        "store-refused",
        "Idempotency store refused the request",
        f"The key store failed in a way that retrying will not mend ({error}), so the "
        "request was not processed. Operators have it in their logs.",
        extra={"error": error},
    )


def unreadable_record(retry_after: float) -> Problem:
    return Problem(
        503,
        "record-unreadable",
        "Stored response unreadable by this server",
        "A request with this key completed, but its stored response was written "
        "by a newer version of this service. Retry with the same key after "
        "Retry-After seconds.",
        retry_after=retry_after,
    )
