import asyncio
import os
import secrets

import asyncpg
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, OutcomeUnknown, PostgresStore
from idempotency_asgi.fastapi import Connection

API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),
    tenant=tenant,
)


class CustomerIn(BaseModel):
    email: str


class ChargeIn(BaseModel):
    amount: int


# start: caught
@app.post("/customers", status_code=201)
async def create_customer(customer: CustomerIn, conn: Connection):
    try:
        await conn.execute("INSERT INTO customers (email) VALUES ($1)", customer.email)
    except asyncpg.UniqueViolationError:
        # The transaction is aborted: the middleware rolls it back and records this
        # 409 on its own, so a retry with the same key gets the same 409.
        exists = {"detail": "a customer with this email exists"}
        return JSONResponse(exists, status_code=409)
    return {"email": customer.email}


# end: caught


CARD_NETWORK_TIMEOUT = 5.0


async def charge_card(amount: int) -> str:
    """Your call to a card network: here, one that answers at once."""
    return f"ch_{secrets.token_hex(8)}"


# start: unknown
@app.post("/charges", status_code=201)
async def create_charge(charge: ChargeIn, conn: Connection):
    try:
        reference = await asyncio.wait_for(
            charge_card(charge.amount), CARD_NETWORK_TIMEOUT
        )
    except asyncio.TimeoutError:
        # The request went out and no answer came: the card may or may not be
        # charged. The key is held (504 outcome-unknown) until its lease lapses; no
        # retry runs meanwhile.
        raise OutcomeUnknown("the card network did not answer") from None
    await conn.execute(
        "INSERT INTO charges (reference, amount) VALUES ($1, $2)",
        reference,
        charge.amount,
    )
    return {"reference": reference}


# end: unknown
