"""The package's exceptions.

    StoreError                 the key store could not do what was asked
    └── StoreUnavailable       unreachable, too slow, or failing: callers fail closed (503)
    OutcomeUnknown             raised by an application: it cannot tell whether its effect happened

The middleware turns every StoreError into a 503 problem answer with Retry-After; the
application never runs on a key that could not be reserved.
"""

from __future__ import annotations


class StoreError(Exception):
    pass


class StoreUnavailable(StoreError):
    pass


class OutcomeUnknown(Exception):
    """Raise it from a handler whose effect may or may not have happened: a call it made to
    another service timed out after the request was sent, say.

    The key is neither recorded nor released: it stays in flight until its lease lapses
    (nothing renews it any more), so no retry runs while the first attempt might still take
    effect; after that a retry takes the key over and runs again. The client gets a 504
    `outcome-unknown` problem. In transactional mode the request's own writes roll back.
    """
