"""The atomic mode: the claim, the handler's writes and the record in one transaction, with
one COMMIT. The transaction is the lease: there is no lease row, no heartbeat, no takeover and
nothing to sweep, and a process that dies mid-request leaves nothing behind (PostgreSQL rolls
its transaction back when the connection drops, and the key is free at once).

1. A first look (`Claims.peek`, one statement, shared under load): a finished record is
   replayed or answered 422, a key in flight answered 409, each in one round trip, without
   opening a transaction.
2. Otherwise the request's transaction begins and tries the key's advisory lock in the same
   round trip, never waiting for it: held by another transaction, the answer is 409.
3. The key's row is read again once the lock is held, by a statement of its own (in the
   transaction at READ COMMITTED, on a connection of the store's otherwise: see
   _sql/atomic.READ): what an owner before committed is seen, whatever the isolation level.
4. The handler runs on that connection; its answer is written with the record (one write of
   the key's row) and committed. Anything else ends in a rollback, and the key is free.

A rolling deploy that mixes modes runs no key twice: a claim of the other modes tries the
same lock before it inserts a new key or takes one over, the atomic read sees the other
modes' rows, and two writers of one key meet at the primary key, where the later one's whole
transaction rolls back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from . import _sql as sql
from ._claiming import Claims, Replaceable, diagnostic_text, judge, new_token
from ._connections import begin_with, bounded, classify, discard, is_closed, time_left
from ._database import Database
from ._errors import StatementUnanswered, StoreError, TransactionFailed
from ._keyhash import key_lock, request_lock
from ._keystore import Claim
from ._records import FORMAT_VERSION, Outcome, StoredResponse, encode_headers
from ._transaction import commit_record, ended

logger = logging.getLogger("idempotency_asgi")

#: The least share of the timeout the record and its COMMIT are given, whatever the claim
#: spent: enough for a database that answers to record the answer.
MIN_BUDGET = 0.25

#: Outcomes of the first look that are answered as they are, without a transaction.
_ANSWERED = frozenset({Outcome.COMPLETED, Outcome.MISMATCH, Outcome.IN_FLIGHT, Outcome.UNREADABLE})


class Atomic:
    def __init__(self, db: Database, claims: Claims) -> None:
        self._db = db
        self._claims = claims
        # Atomic requests in flight per tenant, in this process (`max_in_flight_per_tenant`:
        # they have no row to count while they run).
        self._in_flight: dict[str, int] = {}

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
        isolation: str | None = None,
    ) -> Claim:
        """The key's answer (a replay, 409, 422...), or a run: a Claim whose `hold` is the
        request's transaction, begun, with the key's lock held. Within one timeout in all."""
        kept = self._claims.replay(tenant, key, fingerprint)
        if kept is not None:
            return kept
        deadline = asyncio.get_running_loop().time() + self._db.timeout
        row = await self._claims.peek(
            tenant=tenant, key=key, fingerprint=fingerprint, deadline=deadline
        )
        seen = judge(row, lease_seconds=lease_seconds)
        if isinstance(seen, Claim) and seen.outcome in _ANSWERED:
            self._claims.keep(tenant, key, fingerprint, seen)
            return seen
        if max_in_flight is not None and self._in_flight.get(tenant, 0) >= max_in_flight:
            return Claim(Outcome.OVER_LIMIT)
        request = _Request(
            tenant=tenant,
            key=key,
            method=method,
            path=diagnostic_text(path),
            fingerprint=fingerprint,
            lease_seconds=lease_seconds,
            ttl_seconds=ttl_seconds,
            isolation=isolation,
        )
        return await self._begin(request, deadline, max_keys=max_keys)

    async def _begin(self, request: _Request, deadline: float, *, max_keys: int | None) -> Claim:
        db = self._db
        ticket = db.breaker.admit()  # new work: refused at once while the database is stuck
        try:
            conn = await db.lend(time_left(deadline))
            try:
                tx, held = await bounded(_begin_locked(conn, request, db), time_left(deadline))
            except BaseException as exc:
                discard(conn)  # cut short half way: nobody may reuse it
                await db.lender.give_back(conn)
                if isinstance(exc, asyncio.TimeoutError):
                    db.breaker.stalled(ticket)
                raise classify("cannot begin the request's transaction", exc) from exc
            try:
                claim = await self._read(conn, tx, held, request, deadline, max_keys=max_keys)
            except BaseException as exc:
                await _end(db, conn, tx)
                if isinstance(exc, (asyncio.TimeoutError, StatementUnanswered)):
                    db.breaker.stalled(ticket)
                raise classify("cannot read the key", exc) from exc
            db.breaker.succeeded()
            return claim
        finally:
            db.breaker.ended(ticket)

    async def _read(
        self,
        conn: Any,
        tx: Any,
        held: bool,
        request: _Request,
        deadline: float,
        *,
        max_keys: int | None,
    ) -> Claim:
        """With the key's lock `held`, read the key's row (by a statement of its own: see
        _sql/atomic.READ): a Claim with the transaction to run in, or the answer (and the
        transaction ended)."""
        db = self._db
        answer: Claim | None = None
        seen: Claim | Replaceable | None = None
        if not held:
            answer = Claim(Outcome.IN_FLIGHT, lease_remaining=request.lease_seconds)
        else:
            args = (request.tenant, request.key, request.fingerprint)
            if (request.isolation or db.default_isolation) == "read committed":
                # Each statement its own snapshot: the transaction's connection reads as a
                # connection of the store's would, one backend fewer to wake.
                row = await conn.fetchrow(
                    db.qualified(sql.READ), *args, timeout=time_left(deadline)
                )
            else:
                row = await db.call("fetchrow", sql.READ, *args, deadline=deadline)
            seen = None if row is None else judge(row, lease_seconds=request.lease_seconds)
            if isinstance(seen, Claim):
                answer = seen
            elif seen is None:
                answer = await self._over_quota(request.tenant, max_keys, deadline)
        if answer is not None:
            await _end(db, conn, tx)
            return answer
        replaced = seen if isinstance(seen, Replaceable) else None
        # The request's waits on the database add up to one timeout: what the claim spent
        # (a pool the late COMMITs of a lost standby hold, say) the COMMIT's wait has not.
        budget = max(time_left(deadline), db.timeout * MIN_BUDGET)
        transaction = AtomicTransaction(
            db, conn, tx, request, replaced, budget=budget, ended=self._ended_for(request.tenant)
        )
        self._in_flight[request.tenant] = self._in_flight.get(request.tenant, 0) + 1
        if replaced is None:
            outcome = Outcome.CLAIMED
        else:
            outcome = Outcome.EXPIRED if replaced.expired else Outcome.TAKEN_OVER
        return Claim(outcome, hold=AtomicHold(db, transaction))

    async def _over_quota(self, tenant: str, max_keys: int | None, deadline: float) -> Claim | None:
        """OVER_QUOTA when the tenant already stores `max_keys` keys (counted at most once a
        second per tenant, see _keybound.py); None when this new key may be stored."""
        bound = self._claims.bound_for(tenant, max_keys)
        if bound is None:
            return None
        if bound == 0:
            return Claim(Outcome.OVER_QUOTA)
        stored = await self._db.call("fetchval", sql.COUNT_KEYS, tenant, bound, deadline=deadline)
        over = stored >= bound
        self._claims.counted(tenant, over=over)
        return Claim(Outcome.OVER_QUOTA) if over else None

    def _ended_for(self, tenant: str) -> Callable[[], None]:
        def ended() -> None:
            left = self._in_flight.get(tenant, 0) - 1
            if left > 0:
                self._in_flight[tenant] = left
            else:
                self._in_flight.pop(tenant, None)

        return ended


class _Request:
    """What the atomic mode knows of a keyed request."""

    __slots__ = (
        "fingerprint",
        "isolation",
        "key",
        "lease_seconds",
        "lock",
        "method",
        "path",
        "request_lock",
        "tenant",
        "ttl_seconds",
    )

    def __init__(
        self,
        *,
        tenant: str,
        key: str,
        method: str,
        path: str,
        fingerprint: bytes,
        lease_seconds: float,
        ttl_seconds: float,
        isolation: str | None,
    ) -> None:
        self.tenant = tenant
        self.isolation = isolation
        self.key = key
        self.method = method
        self.path = path
        self.fingerprint = fingerprint
        self.lease_seconds = lease_seconds
        self.ttl_seconds = ttl_seconds
        self.lock = key_lock(tenant, key)
        self.request_lock = request_lock(tenant, key, fingerprint)


async def _begin_locked(conn: Any, request: _Request, db: Database) -> tuple[Any, bool]:
    """BEGIN with the key's lock tried (and the request's taken), in one round trip when
    asyncpg lets us (see `begin_with`): the transaction, and whether the lock is held.
    Where the key table is distributed by Citus, the lock is a statement of its own after
    BEGIN, routed to the tenant's shard (see _sql/atomic.LOCK_KEY)."""
    isolation = None if request.isolation is None else request.isolation.replace(" ", "_")
    if db.distributed:
        tx = conn.transaction(isolation=isolation)
        await tx.start()
        status = await conn.execute(
            db.qualified(sql.LOCK_KEY),
            request.tenant,
            request.key,
            request.lock,
            request.request_lock,
        )
        return tx, status == "SELECT 1"
    statements = sql.begin_locked(request.lock, request.request_lock, request.isolation)
    begun = await begin_with(conn, statements)
    if begun is not None:
        tx, status = begun
        return tx, status == "SELECT 1"
    tx = conn.transaction(isolation=isolation)
    await tx.start()
    status = await conn.execute(statements.split("; ", 1)[1])
    return tx, status == "SELECT 1"


def _record(db: Database) -> str:
    """The record's statement: on Citus, without the wake-up its worker could not deliver
    (see _sql/atomic.RECORD_ROUTED)."""
    return sql.RECORD_ROUTED if db.distributed else sql.RECORD


async def _end(db: Database, conn: Any, tx: Any) -> None:
    """Roll back what is still open (bounded; a connection that cannot is closed) and give the
    connection back. After a COMMIT was sent (`tx` None) the connection is the COMMIT's until
    it ends (see _lending.py), and giving it back does nothing."""
    try:
        if tx is not None:
            await db.lender.rollback(conn, tx)
    finally:
        await db.lender.give_back(conn)


class AtomicTransaction:
    """One atomic request's transaction, begun with the key's lock held: the handler's
    connection (`connection(request)`), then the record and the COMMIT, or a rollback."""

    #: the handler is in the transaction whether or not it asks for the connection
    used = True

    def __init__(
        self,
        db: Database,
        conn: Any,
        tx: Any,
        request: _Request,
        replaced: Replaceable | None,
        *,
        budget: float,
        ended: Callable[[], None],
    ) -> None:
        self._db = db
        self._budget = budget
        self._conn: Any = conn
        self._tx: Any = tx
        self._request = request
        self._replaced = replaced
        self._on_end: Callable[[], None] | None = ended
        self._ended = False
        self._lock = asyncio.Lock()

    @property
    def lease_seconds(self) -> float:
        return self._request.lease_seconds

    async def connection(self) -> Any:
        if self._ended:
            raise ended()
        return self._conn

    def broken(self) -> bool:
        return self._conn is not None and is_closed(self._conn)

    async def record(self, response: StoredResponse, *, ttl_seconds: float) -> datetime | None:
        """Write the key's record with the answer and COMMIT (see `commit_record`); None when
        another writer had put a row there meanwhile (everything rolled back). When the
        application's own statements left the transaction unable to commit
        (TransactionFailed), it is left open, still holding the key, for its answer to be
        recorded on its own (`AtomicHold.record_apart`) before `close()` rolls it back."""
        async with self._lock:
            self._ended = True
            conn, tx = self._conn, self._tx
            db = self._db

            async def write(timeout: float) -> datetime | None:
                args = self.record_args(response, ttl_seconds)
                written: datetime | None = await conn.fetchval(
                    db.qualified(_record(db)), *args, timeout=timeout
                )
                return written

            async def commit(timeout: float) -> None:
                self._tx = None
                await db.lender.commit(conn, tx, timeout=timeout, if_rolled_back=_nothing)

            try:
                written = await commit_record(
                    conn, timeout=self._budget, write=write, commit=commit
                )
            except TransactionFailed:
                if self._tx is None:  # its COMMIT failed: nothing holds the key any more
                    await self._end()
                raise
            except BaseException:
                await self._end()
                raise
            await self._end()
            return written

    def record_args(self, response: StoredResponse, ttl_seconds: float) -> tuple[Any, ...]:
        request, replaced = self._request, self._replaced
        return (
            request.tenant,
            request.key,
            request.method,
            request.path,
            request.fingerprint,
            new_token(),
            FORMAT_VERSION,
            response.status,
            encode_headers(response.headers),
            response.body,
            ttl_seconds,
            None if replaced is None else replaced.token,
            None if replaced is None else replaced.state,
        )

    def hold_args(self) -> tuple[Any, ...]:
        request, replaced = self._request, self._replaced
        return (
            request.tenant,
            request.key,
            request.method,
            request.path,
            request.fingerprint,
            new_token(),
            request.lease_seconds,
            request.ttl_seconds,
            FORMAT_VERSION,
            None if replaced is None else replaced.token,
            None if replaced is None else replaced.state,
        )

    def key_args(self) -> tuple[str, str]:
        return self._request.tenant, self._request.key

    def replaced_by(self, row: Any) -> bool:
        """Whether `row` (the key's row now: its token and state, or None) is another
        writer's, not the one this transaction read."""
        if row is None:
            return False
        replaced = self._replaced
        if replaced is None:
            return True
        return (row["lease_token"], row["state"]) != (replaced.token, replaced.state)

    async def close(self) -> None:
        """Roll back whatever is still open and give the connection back; the key is free.
        Safe to call more than once."""
        async with self._lock:
            self._ended = True
            await self._end()

    async def _end(self) -> None:
        conn, tx = self._conn, self._tx
        self._conn = self._tx = None
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        if conn is not None:
            await _end(self._db, conn, tx)


class AtomicHold:
    """How an atomic request holds its key: by its transaction (see _keystore.KeyHold)."""

    atomic = True

    def __init__(self, db: Database, transaction: AtomicTransaction) -> None:
        self._db = db
        self.transaction = transaction
        self.seconds = transaction.lease_seconds

    def start(self) -> None:
        pass  # nothing to renew: the transaction is the lease

    async def stop(self) -> None:
        pass

    async def complete(self, response: StoredResponse, *, ttl_seconds: float) -> datetime | None:
        return await self.transaction.record(response, ttl_seconds=ttl_seconds)

    async def record_apart(
        self, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """The answer recorded on its own (a 4xx after the handler caught a database error),
        while the aborted transaction still holds the key; None when another writer got the
        key meanwhile."""
        written: datetime | None = await self._db.call(
            "fetchval", _record(self._db), *self.transaction.record_args(response, ttl_seconds)
        )
        return written

    async def release(self) -> None:
        pass  # the rollback frees it: the key never had a row of this request's

    async def keep(self) -> None:
        """The handler could not tell whether its effect happened (OutcomeUnknown): before its
        transaction rolls back (while it still holds the key's lock, so that no retry slips
        in between), the key is written in flight under a lease nobody renews, as in the
        other modes: no retry runs before it lapses."""
        try:
            await self._db.call("execute", sql.HOLD, *self.transaction.hold_args())
        except StoreError as exc:
            logger.error(
                "could not hold the key of a request whose outcome is unknown; a retry may "
                "run it again once its transaction has rolled back: %s",
                exc,
            )

    async def lost(self) -> bool:
        """Whether another writer put the key's row there since it was read (a conflict at
        REPEATABLE READ or SERIALIZABLE says so as a serialization failure)."""
        try:
            row = await self._db.call("fetchrow", sql.KEY_ROW, *self.transaction.key_args())
        except StoreError:
            return False
        return self.transaction.replaced_by(row)


async def _nothing() -> None:
    """A late COMMIT that failed rolled everything back, the key's lock included."""
