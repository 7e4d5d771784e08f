"""What a SQLAlchemy session in the request's transaction costs to make and close, in µs of
CPU, apart from any round trip: `python -m bench.sqlalchemy_session` (DATABASE_URL, or a
PostgreSQL of its own). Each request awaits its connection first (the transaction is begun
then), so the time measured is `idempotency_asgi.sqlalchemy.session(request)` and
`close(request)` alone; neither sends anything."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import idempotency_asgi.sqlalchemy
from examples.local_postgres import LocalPostgres
from idempotency_asgi import IdempotencyMiddleware, PostgresStore, connection, migrate
from tests.helpers import lifespan

REQUESTS = 2000


async def measure(dsn: str, *, atomic: bool) -> list[float]:
    made: list[float] = []

    async def handler(request: Request) -> Response:
        await connection(request)
        started = time.thread_time()
        await idempotency_asgi.sqlalchemy.session(request)
        await idempotency_asgi.sqlalchemy.close(request)
        made.append((time.thread_time() - started) * 1e6)
        return Response(b"ok", status_code=201)

    app = Starlette(routes=[Route("/", handler, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(dsn), tenant=lambda scope: "b", atomic=atomic
    )
    transport = httpx.ASGITransport(app=app)
    async with lifespan(app), httpx.AsyncClient(transport=transport, base_url="http://b") as http:
        for _ in range(REQUESTS):
            await http.post("/", headers={"idempotency-key": str(uuid.uuid4())})
    return made[REQUESTS // 10 :]  # past the first requests (the dialect's initialization)


async def main(dsn: str) -> None:
    await migrate(dsn)
    for atomic in (False, True):
        times = await measure(dsn, atomic=atomic)
        mode = "atomic" if atomic else "transactional"
        print(
            f"{mode}: session(request) + close(request): median {statistics.median(times):.0f} µs,"
            f" p90 {statistics.quantiles(times, n=10)[-1]:.0f} µs over {len(times)} requests"
        )


if __name__ == "__main__":
    configured = os.environ.get("DATABASE_URL")
    server = None if configured else LocalPostgres.temporary()
    try:
        asyncio.run(main(configured or server.start()))  # type: ignore[union-attr]
    finally:
        if server is not None:
            server.stop()
