"""Sending the fuzz's requests over real HTTP, and judging the answers.

Every judgement counts what it saw in a `Tally` before it asserts, so a run's summary holds
the numbers whatever failed; every assertion message carries the evidence: the request as
sent, the answer as received, and the application's runs for the tenant.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.fuzz_requests import Request, show

PROBLEM_PREFIX = "urn:idempotency-asgi:problem:"
REPLAYED = "idempotent-replayed"
#: Headers that describe one delivery (or, Set-Cookie, one caller): never part of a replay.
NOT_REPLAYED = {"date", "server", "set-cookie", "connection", "keep-alive", "transfer-encoding"}


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    requests: int = 0
    server_errors: int = 0  # any 5xx: the application never answers one
    wrong_replays: int = 0  # a replay where none was due, or one that differs from the original
    missed_replays: int = 0  # the same request, answered with anything but the replay
    reruns: int = 0  # the application ran where it must not have

    def summary(self) -> dict[str, Any]:
        return {
            "cases": sum(self.cases.values()),
            "cases_by_test": dict(self.cases),
            "requests": self.requests,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "server_errors": self.server_errors,
            "wrong_replays": self.wrong_replays,
            "missed_replays": self.missed_replays,
            "reruns": self.reruns,
        }


class Wire:
    """The client side. Any 5xx fails at once, before another request is sent: the
    application never answers one (property 1). Uvicorn drops the connection after an
    application error without saying so, so a 5xx also gets a fresh client: the next example
    must not fail on a reset connection instead of on its own evidence."""

    def __init__(self, url: str, tally: Tally) -> None:
        self.url = url
        self.tally = tally
        self.http = self._connect()

    def _connect(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0)

    def close(self) -> None:
        self.http.close()

    def send(self, request: Request, tenant: str, keys: tuple[bytes, ...]) -> httpx.Response:
        headers = [(b"x-tenant", tenant.encode()), (b"x-status", str(request.status).encode())]
        headers += [(b"idempotency-key", key) for key in keys]
        if request.content_type is not None:
            headers.append((b"content-type", request.content_type))
        response = self.http.request(
            request.method, request.url, content=request.content, headers=headers
        )
        self.tally.requests += 1
        self.tally.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.tally.server_errors += 1
            self.http.close()
            self.http = self._connect()
            raise AssertionError(evidence("a 5xx from the middleware", request, response))
        return response

    def runs(self, tenant: str) -> list[str]:
        response = self.http.get(f"/_runs/{tenant}")
        assert response.status_code == 200, response.text
        runs: list[str] = response.json()
        return runs


def describe(response: httpx.Response) -> str:
    shown = {k: v for k, v in response.headers.items() if k not in ("date", "server")}
    return f"{response.status_code} {shown} {show(response.content, 300)}"


def evidence(
    what: str, request: Request, response: httpx.Response, runs: list[str] | None = None
) -> str:
    text = f"{what}\n  request:  {request!r}\n  response: {describe(response)}"
    if runs is not None:
        text += f"\n  application runs for this tenant: {len(runs)}"
    return text


def is_replay(response: httpx.Response) -> bool:
    return response.headers.get(REPLAYED) == "true"


def ran(tally: Tally, response: httpx.Response, request: Request, runs: list[str]) -> str:
    """The application answered this request itself, just now, having seen it as sent."""

    def fail(what: str) -> str:
        return evidence(what, request, response, runs)

    if is_replay(response):
        tally.wrong_replays += 1
    assert not is_replay(response), fail("a replay where the app must run")
    assert response.status_code == request.status, fail("not the app's answer")
    content_type = request.content_type
    echo = _json(response, request, runs)
    assert echo == {
        "run": runs[-1] if runs else None,
        "method": request.method,
        "path": request.path,
        "query": response.request.url.query.decode("latin-1"),
        "content_type": None if content_type is None else content_type.decode("latin-1"),
        "sha256": hashlib.sha256(request.content).hexdigest(),
        "length": len(request.content),
    }, fail("the app saw another request, or this is not its latest run")
    assert response.headers["x-run"] == echo["run"], fail("the run id header")
    run: str = echo["run"]
    return run


def replayed(
    tally: Tally,
    response: httpx.Response,
    original: httpx.Response,
    request: Request,
    runs: list[str],
) -> None:
    """The stored answer, byte for byte, marked as a replay; the application did not run."""
    same = response.status_code == original.status_code and response.content == original.content
    if is_replay(response) and not same:
        tally.wrong_replays += 1
    elif not is_replay(response):
        tally.missed_replays += 1
    if len(runs) != 1:
        tally.reruns += 1

    def fail(what: str) -> str:
        return evidence(f"{what}; the original: {describe(original)}", request, response, runs)

    assert is_replay(response) and same, fail("not a replay of the original")
    assert _replayable(response) == _replayable(original), fail("replayed other headers")
    assert "set-cookie" not in response.headers, fail("a cookie replayed")
    assert len(runs) == 1, fail("the app ran again for a replay")


def refused(
    tally: Tally,
    response: httpx.Response,
    request: Request,
    runs: list[str],
    *,
    status: int,
    problem: str,
    expected_runs: int,
) -> None:
    """The middleware's own problem answer; the application did not run."""
    if is_replay(response):
        tally.wrong_replays += 1
    if len(runs) > expected_runs:
        tally.reruns += 1

    def fail(what: str) -> str:
        return evidence(what, request, response, runs)

    expected = f"{status} {problem}"
    assert not is_replay(response), fail(f"a replay where {expected} was due")
    assert response.status_code == status, fail(f"not {expected}")
    problem_json = response.headers.get("content-type") == "application/problem+json"
    assert problem_json, fail(f"not {expected}: not a problem body")
    body = _json(response, request, runs)
    assert body.get("type") == PROBLEM_PREFIX + problem, fail(f"not {expected}")
    assert body.get("status") == status, fail(f"not {expected}")
    assert len(runs) == expected_runs, fail(f"the app ran ({expected} was due)")


def _json(response: httpx.Response, request: Request, runs: list[str]) -> dict[str, Any]:
    """The body as a JSON object: the app's echo and the middleware's problems are both."""
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    assert isinstance(body, dict), evidence("not a JSON object", request, response, runs)
    return body


def _replayable(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [
        (name.lower(), value)
        for name, value in response.headers.raw
        if name.lower().decode("latin-1") not in NOT_REPLAYED | {REPLAYED}
    ]
