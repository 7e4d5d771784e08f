import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Scope

from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore

API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


# One object for every option, made at import: a mistake names the option and stops
# the app before it serves. Shareable between apps, or with the gateway
# (`build_gateway(..., config=CONFIG)`).
CONFIG = IdempotencyConfig(
    lease_seconds=30.0,  # handlers here may take a while
    wait_seconds=5.0,  # hold a duplicate for the first answer rather than a 409
    fingerprint_headers=("x-api-version",),  # another version is another request
)


async def create_report(request: Request) -> JSONResponse:
    version = request.headers.get("x-api-version")
    return JSONResponse({"version": version}, status_code=201)


app = Starlette(
    routes=[Route("/reports", create_report, methods=["POST"])],
    middleware=[
        Middleware(
            IdempotencyMiddleware,
            store=PostgresStore(os.environ["DATABASE_URL"]),
            tenant=tenant,
            config=CONFIG,
        )
    ],
)
