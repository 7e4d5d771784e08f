"""The benchmarked endpoint, served several ways (BENCH_MODE):

bare    POST /orders: one INSERT through the app's asyncpg pool, 201 + small JSON
plain   the same behind IdempotencyMiddleware (the handler does not use the transaction)
tx      the same, with the INSERT through `connection(request)` (transactional mode)
peer    the same behind asgi-idempotency-header's middleware with its Redis backend
idemkit the same behind idemkit's middleware with its PostgreSQL backend

`x-delay-ms: N` makes the handler wait N ms after its INSERT (to stage a request in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_asgi import IdempotencyMiddleware, PostgresStore, connection

INSERT = "INSERT INTO bench_orders (payload) VALUES ($1) RETURNING id"


def create_app(mode: str, dsn: str, redis_url: str | None = None) -> Any:
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["pool"] = await asyncpg.create_pool(dsn, min_size=10, max_size=10)
        try:
            yield
        finally:
            await state["pool"].close()

    async def order(request: Request) -> Response:
        body = await request.body()
        if mode == "tx":
            conn = await connection(request)
            order_id = await conn.fetchval(INSERT, body)
        else:
            order_id = await state["pool"].fetchval(INSERT, body)
        delay = request.headers.get("x-delay-ms")
        if delay:
            await asyncio.sleep(int(delay) / 1000)
        return Response(
            orjson.dumps({"id": order_id, "status": "accepted"}),
            status_code=201,
            media_type="application/json",
        )

    app: Any = Starlette(routes=[Route("/orders", order, methods=["POST"])], lifespan=lifespan)
    if mode in ("plain", "tx"):
        app.add_middleware(
            IdempotencyMiddleware,
            store=PostgresStore(dsn, min_size=10, max_size=10),
            tenant=lambda scope: "bench",
        )
    elif mode == "peer":
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends.redis import RedisBackend
        from redis.asyncio import Redis

        app = IdempotencyHeaderMiddleware(app, backend=RedisBackend(Redis.from_url(redis_url)))
    elif mode == "idemkit":
        import idemkit
        from idemkit.backends.postgres import PostgresBackend

        backend = PostgresBackend.from_url(dsn, min_size=10, max_size=10)
        config = idemkit.HttpConfig(scope=lambda request: "bench", scope_mode="strict")
        app = idemkit.IdempotencyMiddleware(app, backend=backend, config=config)
    elif mode != "bare":
        raise ValueError(f"unknown BENCH_MODE {mode!r}")
    return app


def _from_environment() -> Any:
    return create_app(
        os.environ["BENCH_MODE"], os.environ["DATABASE_URL"], os.environ.get("REDIS_URL")
    )


app = _from_environment() if os.environ.get("BENCH_MODE") else None
