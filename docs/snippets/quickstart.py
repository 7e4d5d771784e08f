import asyncio
import logging
import os
import secrets

from fastapi import FastAPI
from starlette.types import Scope

from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore

logging.basicConfig(format="%(levelname)s: %(message)s")  # (1)!
logging.getLogger("idempotency_asgi").setLevel(logging.INFO)

API_KEYS = {"sk_test_acme": "acme"}  # (2)!


def tenant(scope: Scope) -> str | None:
    """Who is asking: keys are scoped to it. None: not authenticated."""
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


CONFIG = IdempotencyConfig(www_authenticate="Bearer")  # (3)!

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),
    tenant=tenant,
    config=CONFIG,
)


@app.post("/orders", status_code=201)
async def create_order(order: dict[str, int]):
    await asyncio.sleep(2)  # (4)!
    return {"id": f"ord_{secrets.token_hex(6)}", "items": order}
