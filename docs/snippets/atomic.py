import contextlib
import os
import secrets
from collections.abc import AsyncIterator

import asyncpg
import orjson
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi.fastapi import Connection

DATABASE_URL = os.environ["DATABASE_URL"]
API_KEYS = {"sk_test_acme": "acme"}


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    conn = await asyncpg.connect(DATABASE_URL)  # (1)!
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS payments"
            " (id text PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL)"
        )
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS outbox (id bigserial PRIMARY KEY,"
            " event jsonb NOT NULL, delivered_at timestamptz)"
        )
    finally:
        await conn.close()
    yield


class PaymentIn(BaseModel):
    amount: int
    currency: str


app = FastAPI(lifespan=lifespan)
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(DATABASE_URL),
    tenant=tenant,
    atomic=True,  # (2)!
)


@app.post("/payments", status_code=201)
async def create_payment(payment: PaymentIn, conn: Connection):
    payment_id = f"pay_{secrets.token_hex(8)}"
    await conn.execute(
        "INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3)",
        payment_id,
        payment.amount,
        payment.currency,
    )
    event = {"type": "payment.created", "id": payment_id, "amount": payment.amount}
    await conn.execute(  # (3)!
        "INSERT INTO outbox (event) VALUES ($1::jsonb)", orjson.dumps(event).decode()
    )
    return {"id": payment_id, "amount": payment.amount, "currency": payment.currency}
