"""The atomic mode: the claim, the handler's writes and the record in one transaction, with
one COMMIT. The transaction is the lease: there is no lease row, no heartbeat, no takeover and
nothing to sweep, and a process that dies mid-request leaves nothing behind (PostgreSQL rolls
its transaction back and lets its locks go when the connection drops: the key is free at once).

A request takes one connection and does everything on it, in this order:

1. The first look (PEEK, one statement, no transaction): a finished record is replayed or
   answered 422, a key in flight 409; that one statement is the whole cost of each.
2. BEGIN, with the request's lock and the key's tried in the same round trip (see
   sql/atomic.begin_locked); held by another, the answer is 409.
3. At READ COMMITTED, the key's row read again now that the locks are held: a record an
   owner committed in between is answered as the first look would have.
4. The handler runs on that connection; its answer is written with the record (one write of
   the key's row) and committed, the request's lock let go of in the same round trip.
5. Anything else rolls back. The request's lock is the session's, so the store may still
   write on that connection, holding the request, once the transaction is over (the hold
   after OutcomeUnknown, a 4xx recorded apart); the connection's reset, when it goes back to
   its pool, lets the lock go.

The request never needs a second connection, so a pool the application shares with the store
can never make it wait for itself, whatever its size or the isolation level.

A handler may not end the request's transaction itself. Its own COMMIT or ROLLBACK lets the
key's lock go, but not the request's: a duplicate of the request is still told 409 (another
request with the key may then run; it meets this one's record, if any, at the primary key).
It is found when the answer is to be recorded, answered with a 500 problem, and the key held
as for OutcomeUnknown: what it committed may have happened.

A rolling deploy that mixes modes runs no key twice: a claim of the other modes tries the
same locks before it inserts a new key or takes one over, the first look sees the other
modes' rows, and two writers of one key meet at the primary key, where the later one's
transaction rolls back. Where the key table is distributed by Citus, atomic_citus.py runs
the same protocol with the transaction's locks only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg

from .._errors import (
    SCHEMA_MISSING,
    HandlerEndedTransaction,
    StoreError,
    StoreUnavailable,
    TransactionFailed,
    ended,
)
from .._keystore import Claim
from .._records import FORMAT_VERSION, HeldReason, Outcome, StoredResponse, encode_headers
from . import sql
from .asyncpg_transactions import begin_with
from .claiming import Claims, Replaceable, diagnostic_text, judge, new_token
from .connections import (
    DATABASE_ERRORS,
    bounded,
    classify,
    discard,
    handler_failure,
    is_closed,
    statement_cancelled,
    time_left,
)
from .database import Database
from .keyhash import key_lock, request_lock
from .transaction import commit_record

logger = logging.getLogger("idempotency_asgi")

#: The least share of the timeout the record and its COMMIT are given, whatever the claim
#: spent: enough for a database that answers to record the answer.
MIN_BUDGET = 0.25

#: The share of the timeout a request waits for one of the connections handlers borrow to
#: come free before its first look goes to one of the store's own instead (see
#: `Atomic.claim`): long enough for a saturated pool of fast handlers to turn over (a 10 ms
#: wait sent half the requests of a benchmark at 32 connections on a pool of 10 to the
#: second connection, a backend and a round trip more each), short enough that a replay
#: behind slow handlers is still answered well within the timeout.
LOOK_WAIT_SHARE = 0.25

#: Outcomes a look answers as they are, without a run.
ANSWERED = frozenset({Outcome.COMPLETED, Outcome.MISMATCH, Outcome.IN_FLIGHT, Outcome.UNREADABLE})


class Request:
    """What the atomic mode knows of a keyed request."""

    __slots__ = (
        "fingerprint",
        "idle_seconds",
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
        idle_seconds: float = 0.0,
    ) -> None:
        self.tenant = tenant
        self.key = key
        self.method = method
        self.path = path
        self.fingerprint = fingerprint
        self.lease_seconds = lease_seconds
        self.ttl_seconds = ttl_seconds
        self.isolation = isolation
        self.lock = key_lock(tenant, key)
        self.request_lock = request_lock(tenant, key, fingerprint)
        #: how long another session may wait on the request's idle transaction (see
        #: stalls.py; 0: no bound)
        self.idle_seconds = idle_seconds

    def record_args(
        self, response: StoredResponse, ttl_seconds: float, replaced: Replaceable | None
    ) -> tuple[Any, ...]:
        """The arguments of RECORD_NEW (`replaced` None), or of RECORD."""
        args = (
            self.tenant,
            self.key,
            self.method,
            diagnostic_text(self.path),
            self.fingerprint,
            new_token(),
            FORMAT_VERSION,
            response.status,
            encode_headers(response.headers),
            response.body,
            ttl_seconds,
        )
        if replaced is None:
            return args
        return (*args, replaced.token, replaced.state)

    def replacing_args(
        self, response: StoredResponse, ttl_seconds: float, replaced: Replaceable | None
    ) -> tuple[Any, ...]:
        """The arguments of RECORD, whether or not a row is replaced."""
        args = self.record_args(response, ttl_seconds, replaced)
        return args if replaced is not None else (*args, None, None)

    def hold_args(self, replaced: Replaceable | None, reason: HeldReason) -> tuple[Any, ...]:
        return (
            self.tenant,
            self.key,
            self.method,
            diagnostic_text(self.path),
            self.fingerprint,
            new_token(),
            self.lease_seconds,
            self.ttl_seconds,
            FORMAT_VERSION,
            None if replaced is None else replaced.token,
            None if replaced is None else replaced.state,
            reason.value,
        )


def replaced_by(row: Any, replaced: Replaceable | None) -> bool:
    """Whether `row` (the key's row now: its token and state, or None) is another writer's,
    not the one the request read."""
    if row is None:
        return False
    if replaced is None:
        return True
    return (row["lease_token"], row["state"]) != (replaced.token, replaced.state)


class InFlight:
    """Atomic requests in flight per tenant, in this process (`max_in_flight_per_tenant`:
    they have no row to count while they run)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def full(self, tenant: str, limit: int | None) -> bool:
        return limit is not None and self._counts.get(tenant, 0) >= limit

    def started(self, tenant: str) -> Callable[[], None]:
        """Count one more; returns what to call, once, when it ends."""
        counts = self._counts
        counts[tenant] = counts.get(tenant, 0) + 1

        def ended() -> None:
            left = counts.get(tenant, 0) - 1
            if left > 0:
                counts[tenant] = left
            else:
                counts.pop(tenant, None)

        return ended


class Atomic:
    def __init__(self, db: Database, claims: Claims, in_flight: InFlight) -> None:
        self._db = db
        self._claims = claims
        self._in_flight = in_flight
        #: keys whose first look is under way on a connection handlers borrow, and how many
        self._looking: dict[tuple[str, str], int] = {}

    async def claim(
        self, request: Request, deadline: float, *, max_in_flight: int | None, max_keys: int | None
    ) -> Claim:
        """The key's answer (a replay, 409, 422...), or a run: a Claim whose `hold` is the
        request's transaction, begun, with the locks held. By `deadline` (the loop's clock),
        the wait for a connection included."""
        looking, ident = self._looking, (request.tenant, request.key)
        if ident in looking:
            # Another request of this process looks at the key right now (a storm of retries
            # of one key): this one rides on the store's shared look, one row for all of
            # them, rather than take a connection for the same answer.
            seen = await self._look_apart(request, deadline)
            if isinstance(seen, Claim) and seen.outcome in ANSWERED:
                return self._answered(request, seen)
            return await self._claim(request, deadline, max_in_flight, max_keys, seen)
        looking[ident] = looking.get(ident, 0) + 1
        try:
            return await self._claim(request, deadline, max_in_flight, max_keys, None)
        finally:
            if looking[ident] > 1:
                looking[ident] -= 1
            else:
                del looking[ident]

    async def _look_apart(self, request: Request, deadline: float) -> Claim | Replaceable | None:
        """The first look on the store's own connections (shared under load, see
        `Claims.peek`), holding none of the connections handlers borrow."""
        row = await self._claims.peek(
            tenant=request.tenant,
            key=request.key,
            fingerprint=request.fingerprint,
            deadline=deadline,
        )
        return judge(row, lease_seconds=request.lease_seconds)

    async def _claim(
        self,
        request: Request,
        deadline: float,
        max_in_flight: int | None,
        max_keys: int | None,
        seen: Claim | Replaceable | None,
    ) -> Claim:
        db = self._db
        conn = None
        if seen is None and db.apart and db.lender.busy():
            # Every connection handlers borrow is taken. One that comes free within a quarter
            # of the timeout still takes the first look (under load they turn over fast);
            # otherwise it goes to one of the store's own connections (through the breaker
            # as new work), so that a replay, a 409 or a 422 (a waiting duplicate's) never
            # waits for slow handlers.
            try:
                wait = min(db.timeout * LOOK_WAIT_SHARE, time_left(deadline))
                conn = await db.lend(wait, reset=False)
            except StoreUnavailable:
                seen = await self._look_apart(request, deadline)
                if isinstance(seen, Claim) and seen.outcome in ANSWERED:
                    return self._answered(request, seen)
        try:
            ticket = db.breaker.admit()  # new work: refused at once while the database is stuck
        except BaseException:
            if conn is not None:
                await db.lender.give_back(conn)
            raise
        try:
            if conn is None:
                conn = await db.lend(time_left(deadline), reset=False)
            try:
                # Each statement of the claim bounded by asyncpg (a timer of the loop's own)
                # to what is left of the one deadline.
                claim = await self._claim_on(conn, request, deadline, max_in_flight, max_keys, seen)
            except BaseException as exc:
                discard(conn)  # cut short half way (it may hold the locks): nobody reuses it
                await db.lender.give_back(conn)
                if isinstance(exc, asyncio.TimeoutError):
                    db.breaker.stalled(ticket)
                if isinstance(exc, asyncpg.exceptions.UndefinedTableError):
                    raise StoreUnavailable(f"{SCHEMA_MISSING} ({exc})") from exc
                raise classify("cannot claim the key", exc) from exc
            db.breaker.succeeded()
            return claim
        finally:
            db.breaker.ended(ticket)

    async def _claim_on(
        self,
        conn: Any,
        request: Request,
        deadline: float,
        max_in_flight: int | None,
        max_keys: int | None,
        seen: Claim | Replaceable | None,
    ) -> Claim:
        """The first look (unless it was `seen` already), then BEGIN with the locks and the
        row read again; the connection is given back when the answer needs no run."""
        db = self._db
        if seen is None:
            locks = request.lock, request.request_lock
            row = await conn.fetchrow(
                db.qualified(sql.PEEK),
                request.tenant,
                request.key,
                request.fingerprint,
                *locks,
                timeout=time_left(deadline),
            )
            seen = judge(row, lease_seconds=request.lease_seconds)
        answer: Claim | None = None
        if isinstance(seen, Claim) and seen.outcome is not Outcome.ABSENT:
            answer = self._answered(request, seen)
        elif self._in_flight.full(request.tenant, max_in_flight):
            answer = Claim(Outcome.OVER_LIMIT)
        elif max_keys is not None and not isinstance(seen, Replaceable):
            answer = await self._over_quota(conn, request.tenant, max_keys, deadline)
        if answer is None:
            replaced = seen if isinstance(seen, Replaceable) else None
            begun = await self._begin(conn, request, replaced, deadline)
            if not isinstance(begun, Claim):
                return AtomicRun.claimed(
                    self._db, conn, begun, request, replaced, deadline, self._in_flight
                )
            answer = begun
        await db.lender.give_back(conn)
        return answer

    def _answered(self, request: Request, seen: Claim) -> Claim:
        """A look's answer, kept for the cache of finished records when it is a replay."""
        self._claims.keep(request.tenant, request.key, request.fingerprint, seen)
        return seen

    async def _begin(
        self, conn: Any, request: Request, replaced: Replaceable | None, deadline: float
    ) -> Any:
        """BEGIN with the locks held, and the key's row read again once they are: the
        transaction, or the answer (rolled back, the locks let go of by the connection's
        reset) when they were another's or the row changed since the first look.

        At READ COMMITTED the BEGIN tries both locks in its round trip, and the next
        statement reads the row with a snapshot of its own. At REPEATABLE READ or
        SERIALIZABLE the transaction's snapshot is taken by its first statement, before a
        lock tried in it is had: the request's lock is taken first, alone, the row read by a
        statement after it (outside the transaction, so at SERIALIZABLE it takes no predicate
        lock), and then the transaction begins with the key's lock. One round trip more."""
        db = self._db
        in_flight = Claim(Outcome.IN_FLIGHT, lease_remaining=request.lease_seconds, locked=True)
        if (request.isolation or db.default_isolation) == "read committed":
            statements = sql.begin_locked(request.lock, request.request_lock, request.isolation)
            tx, status = await _begin_with_status(conn, statements, request.isolation, deadline)
            if status != "SELECT 1":
                await db.lender.rollback(conn, tx)  # neither lock is held any more
                return in_flight
            db.lender.must_reset(conn, request.request_lock)  # the session holds it
            answer = await self._read_again(conn, request, replaced, deadline)
            if answer is not None:
                await db.lender.rollback(conn, tx, then=True)
                return answer
            return tx
        if not await conn.fetchval(
            sql.LOCK_REQUEST, request.request_lock, timeout=time_left(deadline)
        ):
            return in_flight
        db.lender.must_reset(conn, request.request_lock)
        answer = await self._read_again(conn, request, replaced, deadline)
        if answer is not None:
            return answer
        statements = sql.begin_key_locked(request.lock, request.isolation)
        tx, status = await _begin_with_status(conn, statements, request.isolation, deadline)
        if status != "SELECT 1":
            await db.lender.rollback(conn, tx, then=True)
            return in_flight
        return tx

    async def _read_again(
        self, conn: Any, request: Request, replaced: Replaceable | None, deadline: float
    ) -> Claim | None:
        """The key's row read with the locks held: None when it is what the first look saw,
        else the answer (an owner committed in between: its record answers)."""
        row = await conn.fetchrow(
            self._db.qualified(sql.READ),
            request.tenant,
            request.key,
            request.fingerprint,
            timeout=time_left(deadline),
        )
        if _unchanged(row, replaced):
            return None
        seen = judge(row, lease_seconds=request.lease_seconds)
        if isinstance(seen, Claim) and seen.outcome in ANSWERED:
            return self._answered(request, seen)
        return Claim(Outcome.IN_FLIGHT, lease_remaining=1.0, locked=row is None)

    async def _over_quota(
        self, conn: Any, tenant: str, max_keys: int, deadline: float
    ) -> Claim | None:
        """OVER_QUOTA when the tenant already stores `max_keys` keys (counted at most once a
        second per tenant, see keybound.py); None when this new key may be stored."""
        bound = self._claims.bound_for(tenant, max_keys)
        if bound is None:
            return None
        if bound == 0:
            return Claim(Outcome.OVER_QUOTA)
        stored = await conn.fetchval(
            self._db.qualified(sql.COUNT_KEYS), tenant, bound, timeout=time_left(deadline)
        )
        over = stored >= bound
        self._claims.counted(tenant, over=over)
        return Claim(Outcome.OVER_QUOTA) if over else None


async def _begin_with_status(
    conn: Any, statements: str, isolation: str | None, deadline: float
) -> Any:
    """Begin by `statements` (a BEGIN and a statement after it, see `begin_with`) by
    `deadline`: the transaction, and the status of the statement after the BEGIN."""
    begun = await begin_with(conn, statements, time_left(deadline))
    if begun is not None:
        return begun
    # This asyncpg does not let a BEGIN of ours stand for its own: the ordinary way.
    tx = conn.transaction(isolation=None if isolation is None else isolation.replace(" ", "_"))
    await bounded(tx.start(), time_left(deadline))
    return tx, await conn.execute(statements.split("; ", 1)[1], timeout=time_left(deadline))


def _unchanged(row: Any, replaced: Replaceable | None) -> bool:
    """Whether the key's row read once the locks are held is the one the first look saw (no
    row, or the same row to replace)."""
    if row is None:
        return replaced is None
    return replaced is not None and (row["lease_token"], row["state"]) == (
        replaced.token,
        replaced.state,
    )


class AtomicRun:
    """One atomic request's run: the key held by its session's locks, the handler's
    transaction (`connection(request)`), and how it ends: the record and the COMMIT, or a
    rollback. It is both the hold on the key and the handler's transaction (see
    _keystore.KeyHold and RequestTransaction)."""

    atomic = True
    short = False
    #: the handler is in the transaction whether or not it asks for the connection
    used = True

    #: what an exception of the handler's says of the database (see connections.py)
    failure = staticmethod(handler_failure)
    cancelled = staticmethod(statement_cancelled)

    def __init__(
        self,
        db: Database,
        conn: Any,
        tx: Any,
        request: Request,
        replaced: Replaceable | None,
        *,
        budget: float,
        ended: Callable[[], None],
    ) -> None:
        self._db = db
        self._conn: Any = conn
        self._tx: Any = tx
        self._request = request
        self._replaced = replaced
        self._budget = budget
        self._on_end: Callable[[], None] | None = ended
        self._ended = False
        self.seconds = request.lease_seconds
        self.idle_seconds = request.idle_seconds
        #: the watch for sessions that wait on the transaction while it sits idle
        self._watch = db.stalls.watch(conn, request.idle_seconds)
        #: what runs once it has committed (see _asgi/aftercommit.py)
        self.on_commit: list[Callable[[], Any]] = []

    @classmethod
    def claimed(
        cls,
        db: Database,
        conn: Any,
        tx: Any,
        request: Request,
        replaced: Replaceable | None,
        deadline: float,
        in_flight: InFlight,
    ) -> Claim:
        """The claim of a run that holds the key now, in transaction `tx` on `conn`."""
        # The request's waits on the database add up to one timeout: what the claim spent
        # (a pool the late COMMITs of a lost standby hold, say) the COMMIT's wait has not.
        budget = max(time_left(deadline), db.timeout * MIN_BUDGET)
        run = cls(
            db, conn, tx, request, replaced, budget=budget, ended=in_flight.started(request.tenant)
        )
        if replaced is None:
            return Claim(Outcome.CLAIMED, hold=run)
        return Claim(Outcome.EXPIRED if replaced.expired else Outcome.TAKEN_OVER, hold=run)

    # -- the handler's side ---------------------------------------------------------------

    @property
    def transaction(self) -> AtomicRun:
        """The run is its own transaction (a property: an attribute holding the run would be
        a reference cycle, garbage only the collector frees, once per request)."""
        return self

    async def connection(self) -> Any:
        if self._ended:
            raise ended()
        return self._conn

    def ended_by_handler(self) -> bool:
        conn = self._conn
        return (
            conn is not None
            and self._tx is not None
            and not is_closed(conn)
            and not conn.is_in_transaction()
        )

    def broken(self) -> bool:
        return self._conn is not None and is_closed(self._conn)

    @property
    def stalled(self) -> bool:
        """Whether a session that waited on the transaction while it sat idle was cancelled
        (see stalls.py; on Citus, a wait on a worker is not seen from the coordinator)."""
        return self._watch is not None and self._watch.stalled

    # -- the hold on the key --------------------------------------------------------------

    def start(self) -> None:
        pass  # nothing to renew: the session's lock holds the key

    async def stop(self) -> None:
        pass

    async def complete(self, response: StoredResponse, *, ttl_seconds: float) -> datetime | None:
        """Write the key's record with the answer and COMMIT (see `commit_record`); None when
        another writer had put a row there meanwhile (everything rolled back). When the
        application's own statements left the transaction unable to commit
        (TransactionFailed), it is rolled back and the session keeps the key, for
        `lost()` and `record_apart()` to be asked before `close()` lets it go."""
        self._ended = True
        conn, tx, db = self._conn, self._tx, self._db
        if not conn.is_in_transaction():
            self._tx = None  # the handler ended it: nothing of ours left to roll back
            raise HandlerEndedTransaction(
                "the handler ended the request's transaction itself (a COMMIT or a ROLLBACK "
                "on the request's connection): its writes may or may not have been committed"
            )
        statement, args, new = self._record(response, ttl_seconds)

        async def write(timeout: float) -> datetime | None:
            try:
                written: datetime | None = await conn.fetchval(statement, *args, timeout=timeout)
            except asyncpg.exceptions.UniqueViolationError:
                if not new:
                    raise
                return None  # a row was put there after all, by a writer that took no lock
            return written

        async def commit(timeout: float) -> None:
            self._tx = None
            await db.lender.commit(conn, tx, timeout=timeout, if_rolled_back=_nothing)

        try:
            written = await commit_record(conn, timeout=self._budget, write=write, commit=commit)
        except TransactionFailed:
            await self._failed_to_commit()
            raise
        except BaseException:
            await self._end()
            raise
        await self._end()
        return written

    def _record(
        self, response: StoredResponse, ttl_seconds: float
    ) -> tuple[str, tuple[Any, ...], bool]:
        """The record's statement, its arguments, and whether it writes a new row (a plain
        INSERT, which a row there after all fails with a unique violation)."""
        new = self._replaced is None
        statement = self._db.qualified(sql.RECORD_NEW if new else sql.RECORD)
        return statement, self._request.record_args(response, ttl_seconds, self._replaced), new

    async def _failed_to_commit(self) -> None:
        """The application's statements left the transaction unable to commit: roll it back,
        the session keeping the key for `lost()` and `record_apart()`."""
        await self._roll_back()
        if is_closed(self._conn):
            await self._end()

    async def record_apart(
        self, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """The answer recorded on its own (a 4xx after the handler caught a database error),
        after the transaction rolled back, while the session still holds the key; None when
        another writer got the key meanwhile."""
        statement, args, new = self._record(response, ttl_seconds)
        try:
            written: datetime | None = await self._conn.fetchval(
                statement, *args, timeout=self._db.timeout
            )
        except asyncpg.exceptions.UniqueViolationError as exc:
            if new:
                return None  # a row was put there after all, by a writer that took no lock
            raise classify("the record could not be written", exc) from exc
        except DATABASE_ERRORS as exc:
            raise classify("the record could not be written", exc) from exc
        except AttributeError as exc:  # its connection was given back: the session is gone
            raise StoreUnavailable("the request's connection is gone") from exc
        return written

    async def release(self) -> None:
        pass  # the rollback and the session's reset free it: the key never had a row of ours

    async def keep(self, reason: HeldReason) -> None:
        """The handler could not tell whether its effect happened (OutcomeUnknown), or ended
        the transaction itself: its writes roll back (what it committed stays), and the key
        is written in flight under a lease nobody renews, as in the other modes: no retry
        runs before it lapses. Written on the request's own connection while its session
        still holds the request's lock, so that no retry slips in between; if that session
        is gone (and its lock with it), on another connection, as soon as may be."""
        await self._roll_back()
        statement = self._db.qualified(sql.HOLD)
        args = self._request.hold_args(self._replaced, reason)
        conn = self._conn
        if conn is not None and not is_closed(conn):
            try:
                await conn.execute(statement, *args, timeout=self._db.timeout)
                return
            except DATABASE_ERRORS as exc:
                if not is_closed(conn):
                    logger.error("could not hold the key of a request: %r", exc)
                    return
        await self._end()  # its connection goes back: the hold needs none of this request's
        try:
            await self._db.call("execute", sql.HOLD, *args)
        except StoreError as exc:
            logger.error(
                "could not hold the key of a request whose outcome is unknown; a retry may "
                "run it again: %s",
                exc,
            )

    async def lost(self) -> bool:
        """Whether another writer put the key's row there since it was read (a conflict at
        REPEATABLE READ or SERIALIZABLE says so as a serialization failure). Asked after the
        rollback, on the request's own connection."""
        request = self._request
        try:
            row = await self._conn.fetchrow(
                self._db.qualified(sql.KEY_ROW),
                request.tenant,
                request.key,
                timeout=self._db.timeout,
            )
        except (*DATABASE_ERRORS, AttributeError):
            return False
        return replaced_by(row, self._replaced)

    async def close(self) -> None:
        """Roll back whatever is still open and give the connection back: its session is
        reset, and the key free. Safe to call more than once."""
        self._ended = True
        await self._end()

    async def _roll_back(self, *, then: bool = False) -> None:
        """Roll back what is still open (bounded; a connection that cannot is closed);
        `then`: the request's lock let go of in the same round trip (see Lender.rollback)."""
        conn, tx = self._conn, self._tx
        self._tx = None
        if tx is not None and conn is not None:
            await self._db.lender.rollback(conn, tx, then=then)

    async def _end(self) -> None:
        await self._roll_back(then=True)
        conn, self._conn = self._conn, None
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
            self._db.stalls.end(self._watch)
        if conn is not None:
            await self._db.lender.give_back(conn)


async def _nothing() -> None:
    """A late COMMIT that failed rolled everything back; the session's reset frees the key."""
