import contextlib
import os
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore

store = PostgresStore(os.environ["DATABASE_URL"])
API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


async def echo(request: Request) -> JSONResponse:
    body = (await request.body()).decode()
    return JSONResponse({"path": request.url.path, "body": body})


api = Starlette(
    routes=[
        Route("/payments", echo, methods=["POST"]),
        Route("/webhooks/{source}", echo, methods=["POST"]),
    ],
    middleware=[
        Middleware(
            IdempotencyMiddleware,
            store=store,
            tenant=tenant,
            exempt_paths=["/webhooks/*"],  # as `api` routes it (/v1/webhooks/...)
        )
    ],
)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    # An outer app does not run a mounted app's lifespan: the store opens on first
    # use, and only this closes it.
    yield
    await store.close()


app = Starlette(routes=[Mount("/v1", api)], lifespan=lifespan)
