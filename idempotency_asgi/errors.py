"""The package's exceptions.

    StoreError                 the key store could not do what was asked
    └── StoreUnavailable       unreachable, too slow, or failing: callers fail closed (503)
    TransactionFailed          the request's own transaction could not commit (the app's error)
    OutcomeUnknown             raised by an application: it cannot tell whether its effect happened

The middleware turns every StoreError into a 503 problem answer with Retry-After; the
application never runs on a key that could not be reserved. A TransactionFailed is not the
store's failure: a statement of the application's failed inside the request's transaction.
"""

from __future__ import annotations


class StoreError(Exception):
    pass


class StoreUnavailable(StoreError):
    pass


class TransactionFailed(Exception):
    """The request's transaction could not record the response and commit: a statement in it
    failed (the application caught a database error and carried on, or a deferred constraint
    failed at COMMIT). Everything in it was rolled back; the database itself is fine.

    `transient` when PostgreSQL rolled it back for a conflict with a concurrent transaction
    (a serialization failure or a deadlock): running the request again may succeed.
    `read_only` when the handler made its transaction READ ONLY, so that the record could not
    be written in it: it wrote nothing either, and the record can be written on its own.
    """

    def __init__(self, message: str, *, transient: bool, read_only: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        self.read_only = read_only


class OutcomeUnknown(Exception):
    """Raise it from a handler whose effect may or may not have happened: a call it made to
    another service timed out after the request was sent, say.

    The key is neither recorded nor released: it stays in flight until its lease lapses
    (nothing renews it any more), so no retry runs while the first attempt might still take
    effect; after that a retry takes the key over and runs again. The client gets a 504
    `outcome-unknown` problem. In transactional mode the request's own writes roll back.
    """
