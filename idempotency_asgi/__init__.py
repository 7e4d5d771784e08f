"""Idempotency-Key middleware for FastAPI and Starlette, stored in PostgreSQL.

The names below are the public API (see the documentation's "Stability" page); the modules
named with a leading underscore are the implementation and may change in any release.
`idempotency_asgi.fastapi`, `.gateway`, `.verify`, `.maintenance` and `.problems` are public
modules of their own.
"""

from ._config import DEFAULT_EXCLUDED_HEADERS, DEFAULT_RELEASE_STATUSES, IdempotencyConfig
from ._consumer import IdempotentConsumer, Processed
from ._context import connection
from ._errors import OutcomeUnknown, StoreError, StoreRefused, StoreUnavailable
from ._middleware import IdempotencyMiddleware, TenantResolver
from ._migrate import migrate
from ._store import PostgresStore
from ._transaction import TransactionEnded
from .maintenance import BackgroundMaintenance, Reaper, Sweeper

__all__ = [
    "DEFAULT_EXCLUDED_HEADERS",
    "DEFAULT_RELEASE_STATUSES",
    "BackgroundMaintenance",
    "IdempotencyConfig",
    "IdempotencyMiddleware",
    "IdempotentConsumer",
    "OutcomeUnknown",
    "PostgresStore",
    "Processed",
    "Reaper",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "Sweeper",
    "TenantResolver",
    "TransactionEnded",
    "connection",
    "migrate",
]
