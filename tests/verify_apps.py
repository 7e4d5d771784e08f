"""Small services for the verify tests, served by uvicorn: one correct in-memory
implementation of the Idempotency-Key draft, and variants broken one way each.

    no_idempotency     every POST makes a new order: duplicates run twice
    unstable_replays   replays carry a new `replayed_at`: not the original's bytes
    ignores_body       the key alone names the request: another body gets the first answer
    draft_only         correct, with no replay marker (the draft defines none)

POST /orders makes an order ({"id": n, "request": <the body>}); `X-Delay-Ms: N` makes it take
N ms (the probes' slow header); every 201 is a new order, so two executions never answer the
same bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

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
) -> Starlette:
    orders = itertools.count(1)
    records: dict[str, _Record] = {}

    async def create(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        body = await request.body()
        if key is None:
            return _json(b'{"error": "Idempotency-Key is required"}', 400)
        record = records.get(key)
        if record is None:
            # Checked and set with no await in between: one event loop, so this is atomic.
            record = records[key] = _Record(body)
            await _delay(request)
            record.answer = _order(orders, body)
            return _json(record.answer, 201)
        if fingerprint and record.body != body:
            return _json(b'{"error": "key reused with another body"}', 422)
        if record.answer is None:
            return _json(b'{"error": "in progress"}', 409, {"Retry-After": "1"})
        answer = record.answer
        if not stable_replays:
            answer = orjson.dumps({**orjson.loads(answer), "replayed_at": time.time()})
        return _json(answer, 201, dict([marker]) if marker else None)

    return Starlette(routes=[Route("/orders", create, methods=["POST"])])


def _no_idempotency() -> Starlette:
    orders = itertools.count(1)

    async def create(request: Request) -> Response:
        body = await request.body()
        await _delay(request)
        return _json(_order(orders, body), 201)

    return Starlette(routes=[Route("/orders", create, methods=["POST"])])


no_idempotency = _no_idempotency()
unstable_replays = memory_app(stable_replays=False)
ignores_body = memory_app(fingerprint=False)
draft_only = memory_app(marker=None)
