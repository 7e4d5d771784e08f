"""The package's exceptions.

    StoreError                 the key store could not do what was asked
    ├── StoreUnavailable       unreachable, too slow, or shutting down: fail closed (503)
    │   ├── CommitPending      a COMMIT outlived the timeout and goes on in the background
    │   └── StatementUnanswered a statement got no answer: it may or may not have taken effect
    └── StoreRefused           a statement of the store's failed for good: fail closed (500)
    TransactionFailed          the request's own transaction could not commit (the app's error)
    HandlerEndedTransaction    the handler committed or rolled back the request's transaction
    KeyTaken                   another writer recorded the key first (atomic mode)
    TransactionEnded           connection(request) asked for after the request's transaction ended
    OutcomeUnknown             raised by an application: it cannot tell whether its effect happened
    ReconciliationRefused      an operator's settle or release of a key was refused
    ├── KeyNotFound            the key has no record (and no request runs it)
    ├── KeyCompleted           the key has an answer already (settle with replace=True)
    └── KeyRunning             the key's request is running: settling must not race it

The middleware turns a StoreUnavailable into a 503 problem answer with Retry-After (the
database may answer again soon) and a StoreRefused into a 500 problem that names the error
(retrying the same request cannot help); the application never runs on a key that could not
be reserved. A TransactionFailed is not the
store's failure: a statement of the application's failed inside the request's transaction.
"""

from __future__ import annotations

from ._reporting import key_hash

#: What is wrong, and what to do, when the store's tables are not there.
SCHEMA_MISSING = (
    "the idempotency tables do not exist in this database: create them with "
    "`idempotency-asgi migrate` (or `alembic upgrade head` in the repository)"
)


class StoreError(Exception):
    """The key store could not do what was asked: `StoreUnavailable` (a state that passes, 503)
    or `StoreRefused` (a failure for good, 500). The middleware answers either with a problem; an
    application sees one only when it calls the store itself."""


class StoreUnavailable(StoreError):
    """The database is unreachable, slower than the store's `timeout`, shutting down, or out
    of resources: a state that passes. Retrying later may succeed."""


class CommitPending(StoreUnavailable):
    """The request's COMMIT did not finish within the timeout. It is not cancelled (that
    would keep it on the primary alone, see `_lending`): it goes on in the background, and the
    key is recorded if it lands, freed if it fails, and left to its lease if the connection
    is lost. The request is answered 503 meanwhile; never release its key at once."""


class StatementUnanswered(StoreUnavailable):
    """One of the store's statements was sent and got no answer in time (or its connection
    was lost): it may or may not have taken effect. A claim that ends so may have reserved
    its key, and frees it again in the background (see `PostgresStore.claim`)."""


class StoreRefused(StoreError):
    """PostgreSQL refused one of the store's own statements in a way that does not pass (a
    value it cannot store, a permission the role lacks): retrying the same request would fail
    the same way, so it is not reported as an outage. `error` names the failure as clients
    may read it: its class and SQLSTATE, never the statement or its values."""

    def __init__(self, message: str, *, error: str) -> None:
        super().__init__(message)
        self.error = error


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


class HandlerEndedTransaction(Exception):
    """The handler ended the request's transaction itself (a COMMIT or a ROLLBACK sent on the
    request's connection): what it wrote before may or may not have been committed, and the
    key's record can no longer be written in the same transaction. A bug in the handler: the
    middleware answers 500 and holds the key in flight until its lease lapses, as for
    OutcomeUnknown, so that no retry runs what may already have happened."""


class KeyTaken(Exception):
    """In the atomic mode, another writer recorded the key before this request's COMMIT (a
    rolling deploy beside an older version that takes no lock): everything rolled back, and
    that writer's answer is the key's."""


#: Links of `__cause__` followed from an exception a handler raised, looking for the database's
#: error (by the store) or a store error (by the middleware): a library's raised from the
#: driver's (SQLAlchemy: two links), and the application wrapping that once or twice more.
#: An OutcomeUnknown is looked for further: anywhere behind the exception (_asgi/outcomes.py).
CAUSE_LINKS = 4


class OutcomeUnknown(Exception):
    """Raise it from a handler whose effect may or may not have happened: a call it made to
    another service timed out after the request was sent, say.

    The key is neither recorded nor released: it stays in flight until its lease lapses
    (nothing renews it any more), so no retry runs while the first attempt might still take
    effect; after that a retry takes the key over and runs again. The client gets a 504
    `outcome-unknown` problem. In transactional mode the request's own writes roll back.
    """


class TransactionEnded(RuntimeError):
    """`connection(request)` was awaited after the request's transaction ended: the response
    was complete (a background task, say), or the request had already been given up."""


def ended() -> TransactionEnded:
    return TransactionEnded(
        "the request's transaction has ended: it commits with the response, so code that "
        "runs after the response (a background task) cannot use it"
    )


class ReconciliationRefused(Exception):
    """`PostgresStore.settle` or `release_key` refused to change a key: nothing was changed.
    `tenant` and `key` name it, `reason` says why; the message shows a hash of the key, never
    the key, so that it can be logged."""

    def __init__(self, reason: str, *, tenant: str, key: str) -> None:
        super().__init__(f"tenant {tenant!r}, key {key_hash(key)}: {reason}")
        self.reason = reason
        self.tenant = tenant
        self.key = key


class KeyNotFound(ReconciliationRefused):
    """The key has no record, and no request is running it: there is nothing to settle."""


class KeyCompleted(ReconciliationRefused):
    """The key has an answer already (the handler's, or an earlier settle's), whose retries
    are replayed: settle it again with `replace=True` to overwrite it, or release it with
    `completed=True` to forget it."""


class KeyRunning(ReconciliationRefused):
    """The key's request is running: its lease is live (its owner renews it), or a request's
    transaction holds its lock (the atomic mode), or its answer is being recorded right now.
    Settling it would race the handler; try again once it ends, or its lease lapses."""
