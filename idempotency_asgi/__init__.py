"""Idempotency-Key middleware for FastAPI and Starlette, stored in PostgreSQL."""

from .context import connection
from .errors import StoreError, StoreUnavailable
from .middleware import IdempotencyMiddleware
from .migrate import migrate
from .records import Claim, Lease, Outcome, StoredResponse
from .store import PostgresStore

__all__ = [
    "Claim",
    "IdempotencyMiddleware",
    "Lease",
    "Outcome",
    "PostgresStore",
    "StoreError",
    "StoreUnavailable",
    "StoredResponse",
    "connection",
    "migrate",
]
