import os
import secrets
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore, after_commit
from idempotency_asgi.fastapi import Connection

DATABASE_URL = os.environ["DATABASE_URL"]
API_KEYS = {"sk_test_acme": "acme"}
receipts: list[str] = []  # stands in for the mail service


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


class PaymentIn(BaseModel):
    amount: int
    currency: str


async def send_receipt(payment_id: str) -> None:
    receipts.append(payment_id)


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware, store=PostgresStore(DATABASE_URL), tenant=tenant
)


# start: handler
@app.post("/payments", status_code=201)
async def create_payment(payment: PaymentIn, request: Request, conn: Connection):
    payment_id = await conn.fetchval(
        "INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3) RETURNING id",
        f"pay_{secrets.token_hex(8)}",
        payment.amount,
        payment.currency,
    )
    after_commit(request, partial(send_receipt, payment_id))  # (1)!
    if payment.amount > 1_000_000:  # a 5xx: rolled back, and no receipt
        return JSONResponse({"detail": "the provider is down"}, status_code=502)
    return {"id": payment_id}


# end: handler
