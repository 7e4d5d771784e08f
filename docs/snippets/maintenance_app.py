import os

from fastapi import FastAPI
from starlette.types import Scope

from idempotency_asgi import (
    BackgroundMaintenance,
    IdempotencyMiddleware,
    PostgresStore,
    Reaper,
    Sweeper,
)

API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


store = PostgresStore(os.environ["DATABASE_URL"])
app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=store,
    tenant=tenant,
    # Every worker starts it; one of them, elected by an advisory lock, does the work.
    maintenance=BackgroundMaintenance(
        Reaper(store),  # finished keys past their retention
        Sweeper(store),  # in-flight keys whose owner died long ago
    ),
)
