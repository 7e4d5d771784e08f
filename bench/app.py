"""The benchmarked endpoint, served several ways (BENCH_MODE):

bare    POST /orders: one INSERT through the app's asyncpg pool, 201 + small JSON
plain   the same behind IdempotencyMiddleware (the handler does not use the transaction)
tx      the same, with the INSERT through `connection(request)` (transactional mode)
atomic  the same in the atomic mode (`atomic=True`: claim, INSERT and record, one COMMIT)
inline-plain  idempotency written by hand in the endpoint, the floor a middleware is
        measured against: a SHA-256 of the raw body, one claim-or-fetch statement, the
        INSERT, one UPDATE storing the answer; a replay answers from the claim's row
inline-tx     the same with the INSERT and the UPDATE in one transaction (two commits)
inline-atomic the atomic mode's floor, one transaction: BEGIN; the key's advisory lock,
        tried; the key's row read in the next statement; the INSERT; the key's row
        inserted with its answer; COMMIT
peer    the same behind asgi-idempotency-header's middleware with its Redis backend
idemkit the same behind idemkit's middleware with its PostgreSQL backend

`x-delay-ms: N` makes the handler wait N ms after its INSERT (to stage a request in flight).
BENCH_BATCH=0 makes the store's statements one per request (PostgresStore(batch=False)).
BENCH_COUNT=1 counts every round trip to PostgreSQL (asyncpg's query logger on every
connection, the store's and the app's: one call, one round trip), read at GET /round-trips;
only for a pass of its own (the logger costs CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
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

#: The hand-written floor's table and statements: no tenants beyond one, no leases, no
#: headers stored, no retention; what an endpoint needs at the least to be idempotent.
INLINE_TABLE = """
CREATE TABLE IF NOT EXISTS bench_inline_keys (
    idempotency_key text PRIMARY KEY,
    fingerprint bytea NOT NULL,
    status smallint,
    body bytea
)"""
INLINE_CLAIM = """
WITH inserted AS (
    INSERT INTO bench_inline_keys (idempotency_key, fingerprint) VALUES ($1, $2)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING true
)
SELECT true AS new, NULL::bytea AS fingerprint, NULL::smallint AS status, NULL::bytea AS body
FROM inserted
UNION ALL
SELECT false, fingerprint, status, body FROM bench_inline_keys
WHERE idempotency_key = $1 AND NOT EXISTS (SELECT 1 FROM inserted)
"""
INLINE_STORE = "UPDATE bench_inline_keys SET status = $2, body = $3 WHERE idempotency_key = $1"
INLINE_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))"
INLINE_READ = "SELECT fingerprint, status, body FROM bench_inline_keys WHERE idempotency_key = $1"
INLINE_RECORD = (
    "INSERT INTO bench_inline_keys (idempotency_key, fingerprint, status, body)"
    " VALUES ($1, $2, $3, $4)"
)


def create_app(mode: str, dsn: str, redis_url: str | None = None) -> Any:
    state: dict[str, Any] = {"round_trips": 0}
    counting = os.environ.get("BENCH_COUNT") == "1"

    def counted(record: Any) -> None:
        state["round_trips"] += 1

    async def init(conn: Any) -> None:
        if counting:
            conn.add_query_logger(counted)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["pool"] = await asyncpg.create_pool(dsn, min_size=10, max_size=10, init=init)
        try:
            yield
        finally:
            await state["pool"].close()

    async def inline_atomic(request: Request) -> Response:
        body = await request.body()
        key = request.headers["idempotency-key"]
        digest = hashlib.sha256(body).digest()
        async with state["pool"].acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                if not await conn.fetchval(INLINE_LOCK, key):
                    return Response(b"in flight", status_code=409)
                row = await conn.fetchrow(INLINE_READ, key)  # after the lock: its own snapshot
                if row is not None:
                    if row["fingerprint"] != digest:
                        return Response(b"key reused", status_code=422)
                    return Response(
                        row["body"], status_code=row["status"], media_type="application/json"
                    )
                order_id = await conn.fetchval(INSERT, body)
                answer = orjson.dumps({"id": order_id, "status": "accepted"})
                await conn.execute(INLINE_RECORD, key, digest, 201, answer)
                await tx.commit()
            finally:
                if conn.is_in_transaction():  # answered before its COMMIT: nothing to keep
                    await tx.rollback()
        return Response(answer, status_code=201, media_type="application/json")

    async def inline(request: Request) -> Response:
        if mode == "inline-atomic":
            return await inline_atomic(request)
        body = await request.body()
        key = request.headers["idempotency-key"]
        digest = hashlib.sha256(body).digest()
        pool = state["pool"]
        row = await pool.fetchrow(INLINE_CLAIM, key, digest)
        if row is None:
            return Response(b"in flight", status_code=409)  # committed after our snapshot
        if not row["new"]:
            if row["fingerprint"] != digest:
                return Response(b"key reused", status_code=422)
            if row["status"] is None:
                return Response(b"in flight", status_code=409)
            return Response(row["body"], status_code=row["status"], media_type="application/json")
        if mode == "inline-tx":
            async with pool.acquire() as conn, conn.transaction():
                order_id = await conn.fetchval(INSERT, body)
                answer = orjson.dumps({"id": order_id, "status": "accepted"})
                await conn.execute(INLINE_STORE, key, 201, answer)
        else:
            order_id = await pool.fetchval(INSERT, body)
            answer = orjson.dumps({"id": order_id, "status": "accepted"})
            await pool.execute(INLINE_STORE, key, 201, answer)
        return Response(answer, status_code=201, media_type="application/json")

    async def order(request: Request) -> Response:
        if mode.startswith("inline"):
            return await inline(request)
        body = await request.body()
        if mode in ("tx", "atomic"):
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

    async def round_trips(request: Request) -> Response:
        return Response(orjson.dumps({"round_trips": state["round_trips"]}))

    app: Any = Starlette(
        routes=[
            Route("/orders", order, methods=["POST"]),
            Route("/round-trips", round_trips, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    if mode in ("plain", "tx", "atomic"):
        app.add_middleware(
            IdempotencyMiddleware,
            store=PostgresStore(
                dsn,
                min_size=10,
                max_size=10,
                batch=os.environ.get("BENCH_BATCH") != "0",
                pool_options={"init": init} if counting else None,
            ),
            tenant=lambda scope: "bench",
            atomic=mode == "atomic",
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
    elif mode not in ("bare", "inline-plain", "inline-tx", "inline-atomic"):
        raise ValueError(f"unknown BENCH_MODE {mode!r}")
    return app


def _from_environment() -> Any:
    return create_app(
        os.environ["BENCH_MODE"], os.environ["DATABASE_URL"], os.environ.get("REDIS_URL")
    )


app = _from_environment() if os.environ.get("BENCH_MODE") else None
