import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Scope

from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore


def tenant(scope: Scope) -> str | None:
    return dict(scope["headers"]).get(b"x-account-id", b"").decode("latin-1") or None


# One object for every option: checked when made (a ValueError names what is wrong),
# shareable between apps, or with the gateway (`build_gateway(..., config=CONFIG)`).
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
