"""FastAPI glue.

- `conn: Connection` in a path operation's parameters: the asyncpg connection inside the
  request's transaction (see `idempotency_asgi.connection`).
- `session: Session`: a SQLAlchemy `AsyncSession` working in that same transaction (see
  `idempotency_asgi.sqlalchemy`; it needs the `sqlalchemy` extra, and only this name does:
  it is imported by name, never by `import *`).
- `**idempotent_route(status_code=201)` in a route decorator: the `Idempotency-Key` header
  parameter, `Idempotent-Replayed` and `Idempotency-Key-Expires` on the success response, and
  the middleware's problem answers, in `/openapi.json`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends

from ._asgi.context import connection

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from .sqlalchemy import request_session

#: The asyncpg connection inside the request's transaction (see `idempotency_asgi.connection`).
Connection = Annotated[Any, Depends(connection)]

if TYPE_CHECKING:
    #: A SQLAlchemy `AsyncSession` inside the request's transaction (see
    #: `idempotency_asgi.sqlalchemy`): its `commit()` releases a savepoint, and its writes
    #: commit with the key's record or not at all.
    Session = Annotated[AsyncSession, Depends(request_session)]


def __getattr__(name: str) -> Any:
    # `Session` is made on first use, so that importing this module needs no SQLAlchemy.
    if name == "Session":
        from . import sqlalchemy  # says which extra to install when SQLAlchemy is absent

        session = Annotated[sqlalchemy.AsyncSession, Depends(sqlalchemy.request_session)]  # type: ignore[name-defined]
        globals()["Session"] = session
        return session
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_PROBLEM = {
    "application/problem+json": {
        "schema": {
            "type": "object",
            "properties": {
                "type": {"type": "string", "format": "uri-reference"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
            },
            "required": ["type", "title", "status", "detail"],
        }
    }
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying with the same key.",
        "schema": {"type": "integer"},
    }
}


def idempotent_route(*, status_code: int = 200, required: bool = True) -> dict[str, Any]:
    """Keyword arguments for `@app.post(...)` that document the idempotency contract."""
    header = {
        "name": "Idempotency-Key",
        "in": "header",
        "required": required,
        "description": (
            "A unique value (a UUID) reused for every retry of this request. A retry gets the "
            "first response back, byte for byte, with Idempotent-Replayed: true."
        ),
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    }
    return {
        "status_code": status_code,
        "openapi_extra": {"parameters": [header]},
        "responses": {
            status_code: {
                "headers": {
                    "Idempotent-Replayed": {
                        "description": "true when this is the stored answer to an earlier request",
                        "schema": {"type": "string", "enum": ["true"]},
                    },
                    "Idempotency-Key-Expires": {
                        "description": "Until when the key is honoured (an HTTP date).",
                        "schema": {"type": "string"},
                    },
                }
            },
            400: {"description": "Idempotency-Key missing or invalid.", "content": _PROBLEM},
            409: {
                "description": "A request with this key is still in progress (or was taken over).",
                "content": _PROBLEM,
                "headers": _RETRY_AFTER,
            },
            422: {
                "description": (
                    "The key was used for a different request (problem+json), or the request "
                    "failed validation."
                ),
                "content": _PROBLEM,
            },
            503: {
                "description": "The idempotency store is unavailable; nothing was processed.",
                "content": _PROBLEM,
                "headers": _RETRY_AFTER,
            },
        },
    }


# Without `Session`, which needs the `sqlalchemy` extra: `from idempotency_asgi.fastapi import *`
# imports every name listed here, and must work without it. Import `Session` by name.
__all__ = ["Connection", "connection", "idempotent_route"]
