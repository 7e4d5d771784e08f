import os
import secrets

from fastapi import FastAPI
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore

API_KEYS = {"sk_test_acme": "acme"}  # your own auth: API keys, a JWT's subject, an account id


def tenant(scope: Scope) -> str | None:
    """Who is asking: keys are scoped to it. None: not authenticated (a keyed request gets 401)."""
    token = dict(scope["headers"]).get(b"authorization", b"").removeprefix(b"Bearer ")
    return API_KEYS.get(token.decode("latin-1"))


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),
    tenant=tenant,
)


@app.post("/orders", status_code=201)
async def create_order(order: dict[str, int]):
    # Runs once per Idempotency-Key; a retry gets this answer again, byte for byte.
    return {"id": f"ord_{secrets.token_hex(6)}", "items": order}
