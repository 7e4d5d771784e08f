"""Idempotency-Key middleware for FastAPI and Starlette, stored in PostgreSQL."""

from .consumer import IdempotentConsumer, Processed
from .context import connection
from .errors import OutcomeUnknown, StoreError, StoreUnavailable
from .middleware import IdempotencyMiddleware
from .migrate import migrate
from .records import Claim, Lease, Outcome, StoredResponse
from .store import PostgresStore

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
