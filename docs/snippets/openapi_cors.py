import os
import secrets

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi.fastapi import idempotent_route

API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


class PaymentIn(BaseModel):
    amount: int
    currency: str


class PaymentOut(BaseModel):
    id: str
    amount: int
    currency: str


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),
    tenant=tenant,
)
# Added last, so it runs first: browsers read these headers only if CORS exposes them.
app.add_middleware(
    CORSMiddleware,
    allow_origins=["https://app.example.com"],
    allow_methods=["POST"],
    allow_headers=["Idempotency-Key", "Authorization", "Content-Type"],
    expose_headers=["Idempotent-Replayed", "Idempotency-Key-Expires", "Retry-After"],
)


# The Idempotency-Key header, the replay headers and the problems in /openapi.json:
@app.post("/payments", response_model=PaymentOut, **idempotent_route(status_code=201))
async def create_payment(payment: PaymentIn):
    return PaymentOut(id=f"pay_{secrets.token_hex(8)}", **payment.model_dump())
