"""Idempotency-Key middleware for FastAPI and Starlette, stored in PostgreSQL."""

from ._consumer import IdempotentConsumer, Processed
from ._context import connection
from ._errors import OutcomeUnknown, StoreError, StoreUnavailable
from ._middleware import IdempotencyMiddleware
from ._migrate import migrate
from ._records import Claim, Lease, Outcome, StoredResponse
from ._store import PostgresStore

__all__ = [
    "Claim",
    "IdempotencyMiddleware",
    "IdempotentConsumer",
    "Lease",
    "Outcome",
    "OutcomeUnknown",
    "PostgresStore",
    "Processed",
    "StoreError",
    "StoreUnavailable",
    "StoredResponse",
    "connection",
    "migrate",
]
