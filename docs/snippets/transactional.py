import contextlib
import os
import secrets
from collections.abc import AsyncIterator

import asyncpg
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
)


@app.post("/payments", status_code=201)
async def create_payment(payment: PaymentIn, conn: Connection):  # (2)!
    row = await conn.fetchrow(
        "INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3)"
        " RETURNING id, amount, currency",
        f"pay_{secrets.token_hex(8)}",
        payment.amount,
        payment.currency,
    )
    return dict(row)
