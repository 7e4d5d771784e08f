"""Idempotency-Key middleware for FastAPI and Starlette, stored in PostgreSQL.

The names below are the public API (see the documentation's "Stability" page); the modules
named with a leading underscore are the implementation and may change in any release.
`idempotency_asgi.fastapi`, `.gateway`, `.verify`, `.maintenance` and `.problems` are public
modules of their own.
"""

from ._asgi.aftercommit import after_commit
from ._asgi.config import DEFAULT_EXCLUDED_HEADERS, DEFAULT_RELEASE_STATUSES, IdempotencyConfig
from ._asgi.context import connection
from ._asgi.middleware import IdempotencyMiddleware, TenantResolver
from ._errors import (
    KeyCompleted,
    KeyNotFound,
    KeyRunning,
    OutcomeUnknown,
    ReconciliationRefused,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    TransactionEnded,
)
from ._postgres.consumer import IdempotentConsumer, Processed
from ._postgres.migrate import migrate
from ._postgres.store import PostgresStore
from ._records import HeldKey, HeldReason, Reconciled
from .maintenance import BackgroundMaintenance, Reaper, Sweeper

__all__ = [
    "DEFAULT_EXCLUDED_HEADERS",
    "DEFAULT_RELEASE_STATUSES",
    "BackgroundMaintenance",
    "HeldKey",
    "HeldReason",
    "IdempotencyConfig",
    "IdempotencyMiddleware",
    "IdempotentConsumer",
    "KeyCompleted",
    "KeyNotFound",
    "KeyRunning",
    "OutcomeUnknown",
    "PostgresStore",
    "Processed",
    "Reaper",
    "Reconciled",
    "ReconciliationRefused",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "Sweeper",
    "TenantResolver",
    "TransactionEnded",
    "after_commit",
    "connection",
    "migrate",
]
