"""FastAPI glue: `conn: Connection` in a path operation's parameters."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends

from .context import connection

#: The asyncpg connection inside the request's transaction (see `idempotency_asgi.connection`).
Connection = Annotated[Any, Depends(connection)]

__all__ = ["Connection", "connection"]
