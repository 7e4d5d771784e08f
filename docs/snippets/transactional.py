import os
import secrets

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi.fastapi import Connection

API_KEYS = {"sk_test_acme": "acme"}


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"").removeprefix(b"Bearer ")
    return API_KEYS.get(token.decode("latin-1"))


class PaymentIn(BaseModel):
    amount: int
    currency: str


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),
    tenant=tenant,
)


@app.post("/payments", status_code=201)
async def create_payment(payment: PaymentIn, conn: Connection):
    # `conn` is an asyncpg connection inside the request's transaction: the payment and the
    # key's record commit together, after the response is complete and before it is sent.
    row = await conn.fetchrow(
        "INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3)"
        " RETURNING id, amount, currency",
        f"pay_{secrets.token_hex(8)}",
        payment.amount,
        payment.currency,
    )
    return dict(row)
