"""A fake payment provider: the downstream the outbox worker delivers to.

`POST /charges` with `Idempotency-Key` (the payments API's tenant and key, forwarded by the
worker) and the event's JSON. It logs every delivery it receives, and books each charge once,
through idempotency_asgi's IdempotentConsumer: the dedup record and the charge commit together.
`GET /charges?idempotency_key=K` answers the charge booked under that key (200), or 404 when
none was: what a reconciliation job asks (see settle_held.py).

Run: `python -m examples.payments.provider` (PORT, default 8001; DATABASE_URL required).
Faults for tests and demos (environment):
    PROVIDER_DROP_ACKS=N        after booking, answer 503 to the first N deliveries of a key
                                (the charge happened, the sender is not told: it will retry)
    PROVIDER_FAIL_CUSTOMERS=a,b  always answer 500 for these customers, booking nothing
    PROVIDER_DELAY_MS=N         sleep this long before answering each delivery
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_asgi import IdempotentConsumer

from .schema import bring_up_to_date
from .settings import asyncpg_dsn


def create_provider(database_url: str | None = None) -> Starlette:
    dsn = asyncpg_dsn(database_url or os.environ["DATABASE_URL"])
    drop_acks = int(os.environ.get("PROVIDER_DROP_ACKS", "0"))
    fail_customers = {c for c in os.environ.get("PROVIDER_FAIL_CUSTOMERS", "").split(",") if c}
    delay = int(os.environ.get("PROVIDER_DELAY_MS", "0")) / 1000

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=10)
        async with pool.acquire() as conn:
            await bring_up_to_date(conn, dsn)
        app.state.pool = pool
        app.state.consumer = IdempotentConsumer(pool, name="provider.charges")
        try:
            yield
        finally:
            await pool.close()

    async def charge(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        if not key:
            return _problem(400, "Idempotency-Key required")
        try:
            event: dict[str, Any] = orjson.loads(await request.body())
            payment = event["payment"]
            amount, currency = int(payment["amount"]), str(payment["currency"])
            payment_id, tenant = str(payment["id"]), str(event["tenant_id"])
            customer = str(payment["customer_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return _problem(400, "malformed event")
        if delay:
            await asyncio.sleep(delay)
        if customer in fail_customers:
            return _problem(500, "provider failure (injected)")
        pool: asyncpg.Pool = request.app.state.pool

        async def book(conn: Any) -> bytes:
            charge_id = "ch_" + secrets.token_hex(10)
            await conn.execute(
                "INSERT INTO provider.charges"
                " (id, idempotency_key, payment_id, tenant_id, amount, currency)"
                " VALUES ($1, $2, $3, $4, $5, $6)",
                charge_id,
                key,
                payment_id,
                tenant,
                amount,
                currency,
            )
            return orjson.dumps({"charge_id": charge_id, "payment_id": payment_id})

        processed = await request.app.state.consumer.process(key, book)
        seen = await pool.fetchval(
            "INSERT INTO provider.deliveries (idempotency_key, first) VALUES ($1, $2)"
            " RETURNING (SELECT count(*) FROM provider.deliveries WHERE idempotency_key = $1)",
            key,
            processed.first,
        )
        if seen < drop_acks:
            return _problem(503, "acknowledgement lost (injected)")
        return Response(
            processed.result or b"{}",
            status_code=201 if processed.first else 200,
            media_type="application/json",
        )

    async def lookup(request: Request) -> Response:
        key = request.query_params.get("idempotency_key")
        if not key:
            return _problem(400, "idempotency_key required")
        pool: asyncpg.Pool = request.app.state.pool
        row = await pool.fetchrow(
            "SELECT id, payment_id, amount, currency FROM provider.charges"
            " WHERE idempotency_key = $1 ORDER BY created_at LIMIT 1",
            key,
        )
        if row is None:
            return _problem(404, "no charge booked under this key")
        found = {
            "charge_id": row["id"],
            "payment_id": row["payment_id"],
            "amount": row["amount"],
            "currency": row["currency"],
        }
        return Response(orjson.dumps(found), media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"ok", media_type="text/plain")

    return Starlette(
        routes=[
            Route("/charges", charge, methods=["POST"]),
            Route("/charges", lookup, methods=["GET"]),
            Route("/healthz", health),
        ],
        lifespan=lifespan,
    )


def _problem(status: int, title: str) -> Response:
    body = orjson.dumps({"type": "about:blank", "title": title, "status": status})
    return Response(body, status_code=status, media_type="application/problem+json")


def __getattr__(name: str) -> Any:
    # `uvicorn examples.payments.provider:app`
    if name == "app":
        application = create_provider()
        globals()["app"] = application
        return application
    raise AttributeError(name)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        "examples.payments.provider:app",
        host=os.environ.get("HOST", "127.0.0.1"),
        port=int(os.environ.get("PORT", "8001")),
    )
