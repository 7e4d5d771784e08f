"""Run the suite with the transactional routes in the atomic mode: IDEMPOTENCY_TEST_MODE=atomic.

The test apps (tests/apps.py, also when uvicorn serves them) then run /tx/... in the atomic
mode unless a test chooses a mode itself. Tests of what only the other modes have (a lease to
lose, renew or take over; a claim row while the handler runs) are marked `two_phase`, and skip.

And with the store made from the application's own asyncpg pool of POOL_SIZE connections
instead of a DSN: IDEMPOTENCY_TEST_STORE=pool. The test apps' default store then shares that
small pool with nothing else of the store's: every statement the store makes, and every
handler's transaction, draws on it, so a request that needed a second connection while it
holds one would wait for itself.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

VARIABLE = "IDEMPOTENCY_TEST_MODE"
STORE_VARIABLE = "IDEMPOTENCY_TEST_STORE"

#: Connections in the application's pool when IDEMPOTENCY_TEST_STORE=pool.
POOL_SIZE = 2


def atomic() -> bool:
    return os.environ.get(VARIABLE, "") == "atomic"


def app_pool() -> bool:
    return os.environ.get(STORE_VARIABLE, "") == "pool"


def transactional_routes(scope: Any) -> bool:
    """The atomic option the apps get: their /tx/ routes, whose handlers write through the
    request's connection (the /plain/ ones write on a pool of their own)."""
    return str(scope["path"]).startswith("/tx/")


own_connections = pytest.mark.own_connections
"""A test of what the store does on connections of its own, apart from the ones handlers
borrow (a DSN's): it skips when IDEMPOTENCY_TEST_STORE=pool, where there are none."""

two_phase = pytest.mark.two_phase
"""A test of the two-phase transactional mode's own machinery (leases, heartbeats,
takeovers, a claim row while the handler runs): it skips when the suite runs atomic."""
