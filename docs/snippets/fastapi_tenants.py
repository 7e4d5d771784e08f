import os
import secrets
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
)
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection
from starlette.types import Scope

from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore

# Your accounts and their API keys (a table, a token service, a JWT's signature).
API_KEYS = {"sk_test_acme": "acme", "sk_test_globex": "globex"}


class APIKeys(AuthenticationBackend):
    """Who is asking, decided once per request, before anything else runs."""

    async def authenticate(
        self, conn: HTTPConnection
    ) -> tuple[AuthCredentials, BaseUser] | None:
        token = conn.headers.get("authorization", "").removeprefix("Bearer ")
        account = API_KEYS.get(token)
        if account is None:
            return None  # anonymous: request.user is not authenticated
        return AuthCredentials(["authenticated"]), SimpleUser(account)


def tenant(scope: Scope) -> str | None:
    user = scope.get("user")  # (1)!
    return user.username if user is not None and user.is_authenticated else None


CONFIG = IdempotencyConfig(www_authenticate="Bearer")

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),
    tenant=tenant,
    config=CONFIG,
)
app.add_middleware(AuthenticationMiddleware, backend=APIKeys())  # (2)!


def account(request: Request) -> str:  # (3)!
    if not request.user.is_authenticated:
        raise HTTPException(401, headers={"WWW-Authenticate": "Bearer"})
    return str(request.user.username)


Account = Annotated[str, Depends(account)]


@app.post("/orders", status_code=201)
async def create_order(order: dict[str, int], account: Account):
    return {"id": f"ord_{secrets.token_hex(6)}", "account": account, "items": order}
