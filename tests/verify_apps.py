"""Small services for the verify tests, served by uvicorn: one correct in-memory
implementation of the Idempotency-Key draft, and variants broken one way each.

    no_idempotency        every POST makes a new order: duplicates run twice
    unstable_replays      replays carry a new `replayed_at`: not the original's bytes
    ignores_body          the key alone names the request: another body gets the first answer
    draft_only            correct, with no replay marker (the draft defines none)
    draft_no_retry_after  the same, and no Retry-After on its 409s (the draft asks for none)

POST /orders makes an order ({"id": n, "request": <the body>}); `X-Delay-Ms: N` makes it take
N ms (the probes' slow header); every 201 is a new order, so two executions never answer the
same bytes. Keys are the credential's own (looked up with the Authorization header), as the
draft's security considerations ask. `refusing` and `limited` wrap an app to refuse a
credential, or to rate-limit each key, before it runs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

MARKER = ("Idempotent-Replayed", "true")


@dataclass
class _Record:
    body: bytes
    answer: bytes | None = None  # None while the first request runs


def _order(orders: itertools.count[int], body: bytes) -> bytes:
    return orjson.dumps({"id": next(orders), "request": body.decode("utf-8", "replace")})


async def _delay(request: Request) -> None:
    delay = request.headers.get("x-delay-ms", "")
    if delay.isdigit():
        await asyncio.sleep(int(delay) / 1000)


def _json(content: bytes, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(content, status, headers=headers, media_type="application/json")


def memory_app(
    *,
    fingerprint: bool = True,
    stable_replays: bool = True,
    marker: tuple[str, str] | None = MARKER,
    retry_after: bool = True,
    answer: bytes | None = None,
    per_credential: bool = True,
) -> Starlette:
    """`answer`: every order answers these bytes (a route that answers alike for the same
    input); `per_credential=False`: a key is looked up alone, so another credential's same
    key gets the first credential's answer."""
    orders = itertools.count(1)
    records: dict[tuple[str, str], _Record] = {}

    async def create(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        body = await request.body()
        if key is None:
            return _json(b'{"error": "Idempotency-Key is required"}', 400)
        credential = request.headers.get("authorization", "") if per_credential else ""
        scoped = (credential, key)
        record = records.get(scoped)
        if record is None:
            # Checked and set with no await in between: one event loop, so this is atomic.
            record = records[scoped] = _Record(body)
            await _delay(request)
            record.answer = _order(orders, body) if answer is None else answer
            return _json(record.answer, 201)
        if fingerprint and record.body != body:
            return _json(b'{"error": "key reused with another body"}', 422)
        if record.answer is None:
            return _json(
                b'{"error": "in progress"}', 409, {"Retry-After": "1"} if retry_after else None
            )
        replayed = record.answer
        if not stable_replays:
            replayed = orjson.dumps({**orjson.loads(replayed), "replayed_at": time.time()})
        return _json(replayed, 201, dict([marker]) if marker else None)

    return Starlette(routes=[Route("/orders", create, methods=["POST"])])


def _no_idempotency() -> Starlette:
    orders = itertools.count(1)

    async def create(request: Request) -> Response:
        body = await request.body()
        await _delay(request)
        return _json(_order(orders, body), 201)

    return Starlette(routes=[Route("/orders", create, methods=["POST"])])


def refusing(app: ASGIApp, credential: str, status: int) -> ASGIApp:
    """`app`, except that requests with `Authorization: <credential>` get `status` and never
    run (a credential without access to the route, or over its quota)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if Headers(scope=scope).get("authorization") == credential:
            await _json(b'{"error": "refused"}', status)(scope, receive, send)
        else:
            await app(scope, receive, send)

    return wrapped


def limited(app: ASGIApp, per_key: int) -> ASGIApp:
    """`app` behind a rate limit: a key's requests beyond the first `per_key` get 429 and
    never run."""
    seen: dict[str, int] = {}

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        key = Headers(scope=scope).get("idempotency-key", "")
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > per_key:
            await _json(b'{"error": "rate limited"}', 429, {"Retry-After": "1"})(
                scope, receive, send
            )
        else:
            await app(scope, receive, send)

    return wrapped


no_idempotency = _no_idempotency()
unstable_replays = memory_app(stable_replays=False)
ignores_body = memory_app(fingerprint=False)
draft_only = memory_app(marker=None)
draft_no_retry_after = memory_app(marker=None, retry_after=False)
