"""Errors the store raises.

    StoreError                 the key store could not do what was asked
    └── StoreUnavailable       unreachable, too slow, or failing: callers fail closed (503)

The middleware turns every StoreError into a 503 problem answer with Retry-After; the
application never runs on a key that could not be reserved.
"""

from __future__ import annotations


class StoreError(Exception):
    pass


class StoreUnavailable(StoreError):
    pass
