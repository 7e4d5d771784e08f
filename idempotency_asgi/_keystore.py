"""What the middleware needs from a key store: the persistence layer, as a protocol.

`PostgresStore` is the one there is. The middleware, a run (`_execution`), its hold on the key
(`_lease`, or the store's atomic transaction) and the maintenance speak to a `KeyStore` only,
so another backend would be a module of its own implementing this, not edits across them.
The claim is one conditional write ("absent, or past its retention, or in flight under a
lapsed lease"); everything that changes a claimed key is fenced by the lease's token.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from ._records import HeldReason, Lease, Outcome, StoredResponse


class RequestTransaction(Protocol):
    """One request's business transaction, committed together with its key's record."""

    #: whether the handler is in it (it asked for its connection, or it is atomic)
    used: bool
    #: what runs once it has committed (see _asgi/aftercommit.py)
    on_commit: list[Callable[[], Any]]

    async def connection(self) -> Any:
        """The handler's connection inside the transaction."""

    def broken(self) -> bool:
        """Whether the transaction's connection is gone (the database failed under it)."""

    #: how long another session may wait on it while it sits idle
    #: (`transaction_idle_seconds`; 0: no bound)
    idle_seconds: float

    @property
    def stalled(self) -> bool:
        """Whether a session that waited on it that long was cancelled (see
        _postgres/stalls.py)."""

    def cancelled(self, exc: BaseException) -> bool:
        """Whether `exc` is a statement the database cancelled (or was raised from one)."""

    def ended_by_handler(self) -> bool:
        """Whether the handler ended the transaction itself (a COMMIT or a ROLLBACK of its
        own): it is no longer in the transaction the store began."""

    def failure(self, exc: BaseException) -> str | None:
        """What an exception the handler raised says of the database: "outage" (it is away
        or overloaded), "conflict" (the transaction lost to a concurrent one), or None (not
        the database's)."""

    async def close(self) -> None:
        """Roll back whatever is still open; safe to call more than once."""


class LeasedTransaction(RequestTransaction, Protocol):
    """The transactional mode's: opened only if the handler asks for its connection."""

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Record the response (fenced by the lease) and commit with it; None when the lease
        was lost."""


class KeyHold(Protocol):
    """What a run holds its key by, and how it ends: a lease (renewed while the application
    runs, the record written with a fenced update) or, in the atomic mode, the request's
    transaction itself."""

    @property
    def atomic(self) -> bool:
        """Whether this is the atomic mode's transaction."""

    @property
    def short(self) -> bool:
        """Whether this is the atomic mode's short path (see `_asgi/onecommit.py`), which
        the middleware runs with an `AtomicRequest` rather than an `Execution`."""

    @property
    def transaction(self) -> RequestTransaction:
        """The transaction the application's handler gets (`connection(request)`)."""

    @property
    def seconds(self) -> float:
        """How long a key held after OutcomeUnknown stays in flight (a 504's Retry-After)."""

    def start(self) -> None:
        """The application starts: keep the key held while it runs."""

    async def stop(self) -> None:
        """The application's answer is in (or it failed): stop renewing."""

    async def complete(self, response: StoredResponse, *, ttl_seconds: float) -> datetime | None:
        """Record the response (and commit the transaction with it); when the record
        expires, or None when the key is no longer this request's."""

    async def record_apart(
        self, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Record the response on its own, the transaction rolled back; as `complete`."""

    async def release(self) -> None:
        """Free the key for the next retry (the transaction rolled back already)."""

    async def keep(self, reason: HeldReason) -> None:
        """Keep the key in flight, renewed by nobody, for its lease from now, saying why
        (for an operator to settle or release it: see `PostgresStore.held`)."""

    async def lost(self) -> bool:
        """Whether another request took the key over meanwhile."""


class ShortHold(RequestTransaction, Protocol):
    """The atomic mode's short path (`_postgres/onecommit.py`): the claim began the request's
    transaction with the key's locks held; the ASGI side (`_asgi/onecommit.py`) ends it."""

    short: bool
    #: how long a key held after OutcomeUnknown stays in flight (a 504's Retry-After)
    seconds: float
    #: set when the COMMIT outlived the timeout (the caller has answered already)
    late: bool

    async def record(
        self, response: StoredResponse, expires_us: int, on_late: Callable[[], None]
    ) -> None:
        """Record the answer, COMMIT and let the key go, in one round trip."""

    async def record_apart(self, response: StoredResponse, expires_us: int) -> bool:
        """Record the answer on its own after the transaction rolled back; False when
        another writer's row is there."""

    async def lost(self) -> bool:
        """Whether another writer put the key's row there meanwhile."""

    async def end(self) -> None:
        """Roll back and let the key go (HandlerEndedTransaction: hold it instead)."""

    async def hold(self, reason: HeldReason) -> None:
        """Keep the key in flight, renewed by nobody, until its lease lapses."""

    def abandon(self) -> None:
        """Close the connection at once (the server rolls back and lets the key go)."""

    def close_to_handler(self) -> None:
        """From now on the handler's `connection(request)`, and the connection it has, raise
        TransactionEnded (its answer is whole, and will not be recorded)."""


@dataclass(frozen=True)
class Claim:
    outcome: Outcome
    lease: Lease | None = None
    response: StoredResponse | None = None
    #: seconds until the in-flight lease lapses (IN_FLIGHT only)
    lease_remaining: float = 0.0
    #: seconds since the in-flight request was claimed (IN_FLIGHT only)
    running_for: float = 0.0
    #: when the finished record stops being replayed (COMPLETED only)
    expires_at: datetime | None = None
    #: what a run holds the key by, when the store made it (the atomic mode's transaction);
    #: otherwise a run holds it by `lease`
    hold: KeyHold | ShortHold | None = None
    #: IN_FLIGHT only: held by a transaction's lock, with no row to wait on (see `wait`)
    locked: bool = False


class KeyStore(Protocol):
    """Idempotency records: claimed, completed or released under a lease, replayed."""

    #: the schema revision this version of the store expects (see `schema_revision`)
    schema_head: str

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def schema_revision(self) -> str | None:
        """The schema revision the store is at; None when its tables are not there."""

    async def claim(
        self,
        *,
        tenant: str,
        key: str,
        method: str,
        path: str,
        fingerprint: bytes,
        lease_seconds: float,
        ttl_seconds: float,
        max_in_flight: int | None = None,
        max_keys: int | None = None,
        atomic: bool = False,
        isolation: str | None = None,
        idle_seconds: float = 0.0,
    ) -> Claim:
        """Reserve the key for this request, or say why not (see `Outcome`)."""

    async def wait(
        self,
        *,
        tenant: str,
        key: str,
        timeout: float,
        locked: bool = False,
        fingerprint: bytes | None = None,
    ) -> None:
        """Return when the key's in-flight request ends, or after `timeout`. `locked`: the
        claim found the key held by a transaction's lock (the atomic mode), with no row;
        `fingerprint`: the waiting request's."""

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost."""

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Store the response if the lease still holds the key; when the record expires."""

    async def release(self, lease: Lease) -> None:
        """Give the key up (fenced by the lease's token)."""

    def release_soon(self, lease: Lease) -> None:
        """Give the key up in the background, trying again while the store is away."""

    async def holds(self, lease: Lease) -> bool:
        """Whether the lease still holds its key."""

    async def hold(self, lease: Lease, reason: HeldReason) -> bool:
        """Hold the key in flight for an operator, for `lease.seconds` from now, saying why;
        False when the lease no longer holds it."""

    def transaction(
        self, isolation: str | None = None, idle_seconds: float = 0.0
    ) -> LeasedTransaction:
        """A transaction for one request, opened only if its handler asks for it (at
        `isolation`, one of _config.ISOLATION_LEVELS; None: the database's default)."""

    async def reap(self, *, batch_size: int) -> int: ...

    async def sweep(self, *, batch_size: int, grace_seconds: float) -> list[dict[str, Any]]: ...

    async def forget_leases(self, *, batch_size: int, grace_seconds: float) -> int: ...

    async def reap_processed(self, *, batch_size: int, retention_seconds: float) -> int: ...

    def exclusive(self, lock_id: int) -> AbstractAsyncContextManager[bool]:
        """Hold a lock among all the store's users while inside, if free (yields whether)."""
