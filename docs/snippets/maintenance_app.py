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


def tenant(scope: Scope) -> str | None:
    return dict(scope["headers"]).get(b"x-account-id", b"").decode("latin-1") or None


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
