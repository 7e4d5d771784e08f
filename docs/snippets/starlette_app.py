import os
import secrets

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Scope

import idempotency_asgi
from idempotency_asgi import IdempotencyMiddleware, PostgresStore

API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


async def create_payment(request: Request) -> JSONResponse:
    body = await request.json()
    conn = await idempotency_asgi.connection(request)  # in the request's transaction
    payment_id = await conn.fetchval(
        "INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3) RETURNING id",
        f"pay_{secrets.token_hex(8)}",
        body["amount"],
        body["currency"],
    )
    return JSONResponse({"id": payment_id}, status_code=201)


app = Starlette(
    routes=[Route("/payments", create_payment, methods=["POST"])],
    middleware=[
        Middleware(
            IdempotencyMiddleware,
            store=PostgresStore(os.environ["DATABASE_URL"]),
            tenant=tenant,
        )
    ],
)
