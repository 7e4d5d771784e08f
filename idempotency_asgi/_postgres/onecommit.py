"""The atomic mode in two round trips of the store's own: the claim in BEGIN's, the record
in COMMIT's (the statements are sql/onecommit.py's).

A request takes one lent connection and does everything on it:

1. `BEGIN` and the claim function, one round trip: the request's lock and the key's
   (the session's, tried), the key's row read after them, a row past its retention
   cleared. A new key is the request's from here on, with its transaction open.
2. The handler runs on that connection (`connection(request)`).
3. The record, `COMMIT`, the locks let go of and the session's reset, one round trip.

Anything else ends with `ROLLBACK`, the locks and the reset in one round trip, or, when the
handler could not tell whether its effect happened (OutcomeUnknown) or ended the transaction
itself, with the key held: written, committed, and only then the locks let go of.

A key that is not new costs the claim and a ROLLBACK (a finished one, a read of its record
in between, to replay it). Keys in flight in this process are answered from memory (409 or
422, no connection at all), a storm of retries of one key rides on the store's shared look,
and while every connection handlers borrow is taken a duplicate or a replay is answered by a
look on a connection apart: only a new key waits for a connection of its own.

No task, shield or timer per request: each step is bounded by the store's one ticking timer
(deadlines.py). A claim that outlives the timeout has its connection closed under it (the
server rolls back, and the locks go with the session); a COMMIT that does is never
cancelled: the caller is told at once (`on_late`), and the COMMIT goes on to land or fail
as PostgreSQL decides (a retry replays it if it landed, runs if it did not), its
connection closed after that.

The transaction is the lease, as in the other atomic path (atomic.py, for the isolation
levels above READ COMMITTED, and atomic_citus.py): a process that dies mid-request leaves
nothing; its session's locks go with its connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from .._errors import (
    SCHEMA_MISSING,
    HandlerEndedTransaction,
    KeyTaken,
    StoreUnavailable,
    TransactionFailed,
    ended,
)
from .._keystore import Claim
from .._records import FORMAT_VERSION, HeldReason, Outcome, StoredResponse, encode_headers
from . import asyncpg_transactions as transactions
from . import sql
from .atomic import ANSWERED, MIN_BUDGET, InFlight, Request
from .claiming import Claims, diagnostic_text, judge, new_token
from .connections import (
    DATABASE_ERRORS,
    SESSION_ENDED,
    classify,
    discard,
    handler_failure,
    is_closed,
    server_answered,
    statement_cancelled,
)
from .database import Database
from .deadlines import Deadlines
from .handed import HandedConnection
from .sql import onecommit as short
from .sql.onecommit import Ending, Found

logger = logging.getLogger("idempotency_asgi")

#: Connections of abandoned runs on their way back (see ShortRun.abandon).
_ABANDONED: set[asyncio.Future[None]] = set()

#: Above this share of recent claims finding their key taken (replays, duplicates), a
#: claim looks first, in one statement, and begins the transaction only for a key nobody
#: has: a key that is not new costs the claim, a ROLLBACK and, to replay it, a read of its
#: record, where a look is all it needs; a new key then costs the look more. Each kind of
#: traffic pays the least for what most of it is.
FOUND_OFTEN = 0.5

#: How long a request waits for a lent connection before it looks at its key on a connection
#: apart: long enough for a pool of fast handlers to turn over under load (each look apart
#: is a statement more, for a new key), short enough that a replay or a 409 behind slow
#: handlers is answered at once, as a person sees it.
LOOK_AFTER = 0.1

#: How the claim's finding reads as a Claim's outcome, for a run.
_RUNS = {
    Found.CLAIMED: Outcome.CLAIMED,
    Found.EXPIRED: Outcome.EXPIRED,
    Found.TAKEN_OVER: Outcome.TAKEN_OVER,
}


class OneCommit:
    """The atomic mode's short path (see the module)."""

    def __init__(
        self, db: Database, claims: Claims, in_flight: InFlight, deadlines: Deadlines
    ) -> None:
        self._db = db
        self._claims = claims
        self._in_flight = in_flight
        self._deadlines = deadlines
        #: keys this process runs now, and the fingerprint of the request running each
        self._running: dict[tuple[str, str], bytes] = {}
        #: keys whose claim is under way in this process, and how many
        self._claiming: dict[tuple[str, str], int] = {}
        #: the share of recent claims that found their key taken (a moving average)
        self._found_lately = 0.0

    def fits(self, isolation: str | None) -> bool:
        """Whether a request at `isolation` takes this path: on one server (not Citus), at
        READ COMMITTED, once a lent connection told where the tables are."""
        db = self._db
        return (
            db.tables is not None
            and not db.distributed
            and (isolation or db.default_isolation) == "read committed"
        )

    async def claim(
        self, request: Request, deadline: float, *, max_in_flight: int | None, max_keys: int | None
    ) -> Claim:
        """The key's answer, or a run (a Claim whose `hold` is a ShortRun, its transaction
        begun with the locks held). Within the timeout, the wait for a connection included."""
        ident = (request.tenant, request.key)
        running = self._running.get(ident)
        if running is not None:
            # In flight in this process: told without asking the database (or waiting for a
            # connection while a small pool is taken).
            if running != request.fingerprint:
                return Claim(Outcome.MISMATCH)
            return Claim(Outcome.IN_FLIGHT, lease_remaining=request.lease_seconds, locked=True)
        claiming = self._claiming
        if ident in claiming and (answered := await self._look_apart(request, deadline)):
            # Another request of this process claims the key right now (a storm of retries
            # of one key): the store's look, shared under load, answers them all.
            return answered
        if self._in_flight.full(request.tenant, max_in_flight):
            # Only a new key is refused: a replay, a 409 or a 422 is never capped.
            return await self._look_anywhere(request, deadline) or Claim(Outcome.OVER_LIMIT)
        bound = self._claims.bound_for(request.tenant, max_keys)
        if bound == 0:
            return Claim(Outcome.OVER_QUOTA)
        claiming[ident] = claiming.get(ident, 0) + 1
        try:
            return await self._claim(request, deadline, bound)
        finally:
            if claiming[ident] > 1:
                claiming[ident] -= 1
            else:
                del claiming[ident]

    async def _look_apart(self, request: Request, deadline: float) -> Claim | None:
        """The key's answer from a look on a connection apart from the lent ones (the
        store's statement connections, shared under load; or the one kept beside an
        application's pool); None when it is to be claimed, or there is no such connection."""
        db = self._db
        if db.apart:
            row = await self._claims.peek(
                tenant=request.tenant,
                key=request.key,
                fingerprint=request.fingerprint,
                deadline=deadline,
            )
        elif db.looks is not None:
            row = await db.look(
                sql.PEEK,
                request.tenant,
                request.key,
                request.fingerprint,
                request.lock,
                request.request_lock,
                deadline=deadline,
            )
        else:
            return None
        seen = judge(row, lease_seconds=request.lease_seconds)
        if isinstance(seen, Claim) and seen.outcome in ANSWERED:
            return self._answered(request, seen)
        return None

    async def _look_anywhere(self, request: Request, deadline: float) -> Claim | None:
        """The key's answer from a look apart, or on a lent connection where there is no
        connection apart; None when nobody has the key."""
        db = self._db
        if db.apart or db.looks is not None:
            return await self._look_apart(request, deadline)
        conn = await db.lend(max(deadline - self._deadlines.now(), 0.001), reset=False)
        step = self._deadlines.start(conn.terminate, at=deadline)
        try:
            return await self._look(conn, request)
        except BaseException as exc:
            discard(conn)
            raise classify("cannot look at the key", exc) from exc
        finally:
            self._deadlines.end(step)
            await db.lender.give_back(conn)

    async def _lend(self, request: Request, deadline: float) -> Any:
        """A lent connection by `deadline`, or, when none came free within LOOK_AFTER (the
        handlers are slow, or a small pool is taken), the key's answer from a look apart: a
        replay, a 409 or a 422 does not wait for slow handlers, only a new key does."""
        db, deadlines = self._db, self._deadlines
        left = deadline - deadlines.now()
        if left > LOOK_AFTER and db.lender.busy() and (db.apart or db.looks is not None):
            try:
                return await db.lend(LOOK_AFTER, reset=False)
            except StoreUnavailable:
                answered = await self._look_apart(request, deadline)
                if answered is not None:
                    return answered
                left = deadline - deadlines.now()
        return await db.lend(max(left, 0.001), reset=False)

    async def _claim(self, request: Request, deadline: float, bound: int | None) -> Claim:
        db = self._db
        ticket = db.breaker.admit()  # new work: refused at once while the database is stuck
        try:
            conn = await self._lend(request, deadline)
            if isinstance(conn, Claim):
                return conn
            schema = db.schema
            run = new_token()
            statement = short.claim(
                schema,
                short.BEGINS[request.isolation],
                tenant=request.tenant,
                key=request.key,
                fingerprint=request.fingerprint,
                key_lock=request.lock,
                request_lock=request.request_lock,
                bound=bound,
                run=run,
            )
            step = self._deadlines.start(conn.terminate, at=deadline)
            looked: Claim | None = None
            try:
                if self._found_lately > FOUND_OFTEN:
                    looked = await self._look(conn, request)
                if looked is None:
                    tx, status = await transactions.begin(conn, statement, request.isolation)
                    found = Found(int(status[7:]))
                    self._found_lately += (float(found not in _RUNS) - self._found_lately) / 32
                    if found not in _RUNS:
                        answer = await self._not_new(conn, tx, request, found)
            except BaseException as exc:
                expired = step.expired
                self._deadlines.end(step)  # before the connection goes back
                discard(conn)  # cut short half way (it may hold the locks): nobody reuses it
                await db.lender.give_back(conn)
                # Not answered in time (an error the server sent is an answer; a cancel
                # stays one).
                if expired and isinstance(exc, Exception) and not server_answered(exc):
                    db.breaker.stalled(ticket)
                    raise StoreUnavailable(
                        f"the key store did not answer within {db.timeout:g} s"
                    ) from exc
                if isinstance(exc, asyncpg.exceptions.UndefinedFunctionError):
                    raise StoreUnavailable(f"{SCHEMA_MISSING} ({exc})") from exc
                raise classify("cannot claim the key", exc) from exc
            finally:
                self._deadlines.end(step)
            db.breaker.succeeded()
            if step.expired and looked is None and found in _RUNS:
                # Answered as the timer went off (this process was late to read it, not the
                # database to answer): the connection, closed all the same, took the locks
                # and the transaction with it. (An answer read in time stands.)
                await db.lender.give_back(conn)
                raise StoreUnavailable(f"the key store did not answer within {db.timeout:g} s")
        finally:
            db.breaker.ended(ticket)
        if looked is not None:
            await db.lender.give_back(conn)
            return looked
        if bound is not None and found is not Found.OVER_QUOTA:
            self._claims.counted(request.tenant, over=False)
        if found not in _RUNS:
            await db.lender.give_back(conn)
            return answer
        # The request's waits on the database add up to one timeout: what the claim spent
        # (waiting for a connection the late COMMITs of a lost standby hold, say) the
        # COMMIT's wait has not, but for the least a database that answers needs.
        budget = max(deadline - self._deadlines.now(), db.timeout * MIN_BUDGET)
        replaced = found is not Found.CLAIMED
        hold = ShortRun(self, conn, tx, request, schema, run, budget=budget, replaced=replaced)
        return Claim(_RUNS[found], hold=hold)

    async def _look(self, conn: Any, request: Request) -> Claim | None:
        """The key's answer from a look of one statement (see `FOUND_OFTEN`); None when the
        key is to be claimed (nobody has it, or its row may be replaced)."""
        row = await conn.fetchrow(
            self._db.qualified(sql.PEEK),
            request.tenant,
            request.key,
            request.fingerprint,
            request.lock,
            request.request_lock,
        )
        seen = judge(row, lease_seconds=request.lease_seconds)
        answered = isinstance(seen, Claim) and seen.outcome in ANSWERED
        self._found_lately += (float(answered) - self._found_lately) / 32
        if isinstance(seen, Claim) and answered:
            return self._answered(request, seen)
        return None

    async def _not_new(self, conn: Any, tx: Any, request: Request, found: Found) -> Claim:
        """The answer for a key the claim did not take (its locks are let go of already), its
        record read first when there is one to replay; the transaction rolled back."""
        answer: Claim
        if found is Found.LOCKED:
            answer = Claim(Outcome.IN_FLIGHT, lease_remaining=request.lease_seconds, locked=True)
        elif found is Found.MISMATCH:
            answer = Claim(Outcome.MISMATCH)
        elif found is Found.OVER_QUOTA:
            self._claims.counted(request.tenant, over=True)
            answer = Claim(Outcome.OVER_QUOTA)
        else:
            row = await conn.fetchrow(
                self._db.qualified(sql.READ), request.tenant, request.key, request.fingerprint
            )
            seen = judge(row, lease_seconds=request.lease_seconds)
            if isinstance(seen, Claim) and seen.outcome in ANSWERED:
                answer = self._answered(request, seen)
            else:  # gone since (released, reaped): in flight for a moment more
                answer = Claim(Outcome.IN_FLIGHT, lease_remaining=1.0, locked=row is None)
        await transactions.end(conn, tx, Ending("", "ROLLBACK", ""))
        return answer

    def _answered(self, request: Request, seen: Claim) -> Claim:
        """A look's answer, kept for the cache of finished records when it is a replay."""
        self._claims.keep(request.tenant, request.key, request.fingerprint, seen)
        return seen

    def started(self, request: Request) -> Callable[[], None]:
        """The request runs: known in this process until what this returns is called."""
        ident = (request.tenant, request.key)
        self._running[ident] = request.fingerprint
        counted = self._in_flight.started(request.tenant)
        running = self._running

        def ended() -> None:
            if running.get(ident) is request.fingerprint:
                del running[ident]
            counted()

        return ended


class ShortRun:
    """One atomic request's run on the short path: the key held by its session's locks, the
    handler's transaction (`connection(request)`), and how it ends. It is both the hold on
    the key and the handler's transaction (see _keystore.KeyHold and RequestTransaction),
    and the ASGI side drives it (`_asgi/onecommit.py`)."""

    atomic = True
    short = True
    #: the handler is in the transaction whether or not it asks for the connection
    used = True

    #: what an exception of the handler's says of the database (see connections.py)
    failure = staticmethod(handler_failure)
    cancelled = staticmethod(statement_cancelled)

    def __init__(
        self,
        path: OneCommit,
        conn: Any,
        tx: Any,
        request: Request,
        schema: str,
        run: int,
        *,
        budget: float,
        replaced: bool,
    ) -> None:
        self._path = path
        self._conn: Any = conn
        #: asyncpg's view of the transaction (see asyncpg_transactions.begin), until the run ends it
        self._tx: Any = tx
        self._request = request
        self._schema = schema
        #: the run's mark, which the claim set for its transaction and its session
        self._run = run
        self._replaced = replaced
        #: how long the record and its COMMIT may take before the client is answered 503
        self._budget = budget
        self._handed = HandedConnection(conn)
        self._ended = path.started(request)
        self.seconds = request.lease_seconds
        self.idle_seconds = request.idle_seconds
        #: the watch for sessions that wait on the transaction while it sits idle
        self._watch = path._db.stalls.watch(conn, request.idle_seconds)
        #: what runs once it has committed (see _asgi/aftercommit.py)
        self.on_commit: list[Callable[[], Any]] = []
        #: set when the COMMIT outlived the timeout: the caller has answered already
        self.late = False
        self._closed_to_handler = False

    @property
    def transaction(self) -> ShortRun:
        """The run is its own transaction (a property: an attribute holding the run would be
        a reference cycle, garbage only the collector frees, once per request)."""
        return self

    # -- the handler's side -----------------------------------------------------------------

    async def connection(self) -> Any:
        if self._conn is None or self._closed_to_handler:
            raise ended()
        return self._handed

    def close_to_handler(self) -> None:
        self._closed_to_handler = True
        self._handed.detach()

    def ended_by_handler(self) -> bool:
        """Whether the handler ended the transaction with a COMMIT or a ROLLBACK of its own
        and began none (told without a round trip; one it began again is told by the
        record, or by the rollback)."""
        conn = self._conn
        return conn is not None and not is_closed(conn) and not conn.is_in_transaction()

    def broken(self) -> bool:
        return self._conn is not None and is_closed(self._conn)

    @property
    def stalled(self) -> bool:
        """Whether a session that waited on the transaction while it sat idle was cancelled
        (see stalls.py)."""
        return self._watch is not None and self._watch.stalled

    # -- how it ends ------------------------------------------------------------------------

    async def record(
        self, response: StoredResponse, expires_us: int, on_late: Callable[[], None]
    ) -> None:
        """Write the record, COMMIT, let the locks go: one round trip. Raises
        HandlerEndedTransaction (nothing committed; the caller holds the key),
        TransactionFailed (the application's statements left the transaction unable to
        commit: rolled back, the locks still held for `record_apart` or `end`),
        StoreUnavailable (the database failed: rolled back, or unknown when the connection
        was lost). `on_late` is called if the round trip outlives the timeout: the COMMIT
        goes on, and this returns or raises when PostgreSQL has decided."""
        request = self._request
        self._handed.detach()
        args = self._record_args(response, expires_us)
        statement = short.record(self._schema, request.lock, request.request_lock, args)
        deadlines = self._path._deadlines
        step = deadlines.start(lambda: self._outlived(on_late), self._budget)
        try:
            # Never cancelled by a timeout of the driver's (`command_timeout`): a COMMIT is
            # bounded by the step above, which answers the client and lets it go on.
            await self._end_with(statement)
        except asyncpg.PostgresError as exc:
            deadlines.end(step)
            await self._record_failed(exc)
        except BaseException as exc:
            deadlines.end(step)
            await self._lost()
            if isinstance(exc, Exception):
                raise StoreUnavailable(f"the transaction's database failed: {exc!r}") from exc
            raise
        deadlines.end(step)
        await self._give_back(closed=self.late)

    def _outlived(self, on_late: Callable[[], None]) -> None:
        self.late = True
        on_late()

    async def _record_failed(self, exc: asyncpg.PostgresError) -> None:
        conn = self._conn
        if isinstance(exc, SESSION_ENDED) or is_closed(conn):
            await self._lost()
            raise StoreUnavailable(f"the transaction's database failed: {exc!r}") from exc
        if exc.sqlstate == short.ENDED:
            raise HandlerEndedTransaction(
                "the handler ended the request's transaction itself (a COMMIT or a ROLLBACK "
                "on the request's connection, and then a BEGIN): what it wrote before may "
                "have been committed"
            ) from exc
        if isinstance(exc, asyncpg.exceptions.UniqueViolationError) and "idempotency_keys" in (
            getattr(exc, "table_name", None) or ""
        ):
            # A writer that took no lock put the key's row there first (a deploy of an older
            # version beside this one): its answer is the key's.
            await self.end()
            raise KeyTaken("another writer recorded the key first") from exc
        # The application's statements left the transaction unable to commit (aborted,
        # read-only, a deferred constraint, a conflict): it is over, rolled back (checked:
        # an aborted transaction may be the handler's second, after it committed ours).
        if conn.is_in_transaction():
            await self._roll_back_only()
        raise TransactionFailed(
            f"the request's transaction could not commit: {exc!r}",
            transient=isinstance(exc, asyncpg.exceptions.TransactionRollbackError),
            read_only=isinstance(exc, asyncpg.exceptions.ReadOnlySQLTransactionError),
        ) from exc

    async def _roll_back_only(self) -> None:
        """ROLLBACK, the locks kept (for `record_apart`, `lost` and `end`); raises
        HandlerEndedTransaction when the handler had committed the transaction itself."""
        await self._ending(Ending("", "ROLLBACK", short.rolled_back(self._schema, self._run)))

    async def record_apart(self, response: StoredResponse, expires_us: int) -> bool:
        """The answer recorded on its own (a 4xx after the handler caught a database error),
        the transaction rolled back, the locks still held; False when another writer's row
        is there. Ends the run."""
        request = self._request
        if self._conn is None:
            raise StoreUnavailable("the request's connection is gone")
        statement = short.record(
            self._schema,
            request.lock,
            request.request_lock,
            self._record_args(response, expires_us, apart=True),
        )
        try:
            await self._bounded(
                self._conn.execute(
                    f"BEGIN; {statement.text}", timeout=transactions.commit_timeout(self._conn)
                )
            )
        except asyncpg.exceptions.UniqueViolationError:
            await self.end()
            return False
        except BaseException as exc:
            await self._lost()
            raise classify("the record could not be written", exc) from exc
        await self._give_back()
        return True

    async def lost(self) -> bool:
        """Whether another writer put the key's row there meanwhile (asked after a conflict
        failed the COMMIT, the locks still held)."""
        request = self._request
        try:
            row = await self._bounded(
                self._conn.fetchrow(
                    self._path._db.qualified(sql.KEY_ROW), request.tenant, request.key
                )
            )
        except (*DATABASE_ERRORS, AttributeError):
            return False
        except BaseException:
            await self._lost()
            raise
        return row is not None

    async def end(self) -> None:
        """Roll back what is still open and let the key go (a 5xx, an exception): one round
        trip. Raises HandlerEndedTransaction, with the locks still held, when the handler
        had committed the transaction itself (the caller then holds the key)."""
        conn = self._conn
        if conn is None:
            return
        self._handed.detach()
        request = self._request
        if is_closed(conn):
            await self._give_back()
            return
        if not conn.is_in_transaction():
            statement = short.release(request.lock, request.request_lock)
        else:
            statement = short.rollback(self._schema, request.lock, request.request_lock, self._run)
        await self._ending(statement)
        await self._give_back()

    async def close(self) -> None:
        """End the run whatever happened: roll back and let the key go (held instead when
        the handler had committed the transaction itself). Safe to call more than once."""
        try:
            await self.end()
        except HandlerEndedTransaction:
            await self.hold(HeldReason.TRANSACTION_ENDED)

    async def hold(self, reason: HeldReason) -> None:
        """Keep the key in flight under a lease nobody renews (OutcomeUnknown, a handler that
        ended the transaction itself): its writes roll back (what it committed stays), the
        key's row is written in flight and committed while the locks are still held, and
        only then are they let go of. If the request's session is gone (and its locks with
        it), on another connection, as soon as may be."""
        conn, request = self._conn, self._request
        if conn is None:
            return
        self._handed.detach()
        args = (
            request.tenant,
            request.key,
            request.method,
            diagnostic_text(request.path),
            request.fingerprint,
            new_token(),
            request.lease_seconds,
            request.ttl_seconds,
            FORMAT_VERSION,
            reason.value,
        )
        if not is_closed(conn):
            statement = short.hold(
                self._schema,
                request.lock,
                request.request_lock,
                args,
                rollback=conn.is_in_transaction(),
            )
            try:
                await self._bounded(self._end_with(statement))
            except DATABASE_ERRORS as exc:
                logger.error("could not hold the key of a request: %r", exc)
                discard(conn)
            except BaseException:
                await self._lost()
                raise
            else:
                await self._give_back()
                return
        await self._give_back()
        # Its session is gone, and its locks with it: hold the key from another connection.
        try:
            await self._path._db.call(
                "execute",
                f"SELECT {self._schema}.idempotency_asgi_hold($1, $2, $3, $4, $5, "
                "$6, $7, $8, $9, $10)",
                *args,
            )
        except Exception as exc:
            logger.error(
                "could not hold the key of a request whose outcome is unknown; a retry may "
                "run it again: %r",
                exc,
            )

    def abandon(self) -> None:
        """Close the connection at once (the server rolls back and lets the locks go): what
        a run cut short (cancelled while it ended) still does without awaiting anything.
        Safe to call more than once, and after the run ended."""
        conn = self._release()
        if conn is None:
            return
        discard(conn)
        task = asyncio.ensure_future(self._path._db.lender.give_back(conn))
        _ABANDONED.add(task)
        task.add_done_callback(_ABANDONED.discard)

    # -- the connection ---------------------------------------------------------------------

    def _record_args(
        self, response: StoredResponse, expires_us: int, *, apart: bool = False
    ) -> tuple[Any, ...]:
        request = self._request
        return (
            request.tenant,
            request.key,
            request.method,
            diagnostic_text(request.path),
            request.fingerprint,
            self._run,  # the row's token: as random as any, and drawn once per request
            FORMAT_VERSION,
            response.status,
            encode_headers(response.headers),
            response.body,
            expires_us,
            self._replaced,
            None if apart else str(self._run),
        )

    async def _ending(self, ending: Ending) -> None:
        """Run `ending`, a rollback checked by its run's mark, bounded: HandlerEndedTransaction
        when the check finds that the handler had committed the transaction itself (the
        connection kept, for the hold); the connection closed when it fails otherwise (the
        server rolls back what it left, and its locks go)."""
        try:
            await self._bounded(self._end_with(ending))
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == short.ENDED:
                raise HandlerEndedTransaction(
                    "the handler committed the request's transaction itself"
                ) from exc
            await self._lost()
        except BaseException:
            await self._lost()
            raise

    async def _end_with(self, ending: Ending) -> None:
        """Run `ending`, which ends the transaction, keeping asyncpg's view of it right."""
        tx, self._tx = self._tx, None
        await transactions.end(self._conn, tx, ending)

    async def _bounded(self, awaitable: Any) -> Any:
        """A step of the run's own after the record (a rollback, the hold): the connection
        closed under it if it outlives the timeout (the server rolls back what it left)."""
        deadlines = self._path._deadlines
        step = deadlines.start(self._conn.terminate)
        try:
            return await awaitable
        finally:
            deadlines.end(step)

    async def _lost(self) -> None:
        """The round trip was cut short (cancelled, or the connection lost): whether it
        committed is PostgreSQL's to say; nobody reuses the connection, whose session's locks
        go with it."""
        await self._give_back(closed=True)

    def _release(self) -> Any:
        """The run lets its connection go (None when it had already): the handler's view
        detached, the key no longer running in this process, the watch ended. What becomes
        of the connection is the caller's."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._handed.detach()
            self._ended()
            self._path._db.stalls.end(self._watch)
        return conn

    async def _give_back(self, *, closed: bool = False) -> None:
        conn = self._release()
        if conn is None:
            return
        if closed:
            discard(conn)  # not to be reused: a COMMIT that outlived the timeout, a lost trip
        await self._path._db.lender.give_back(conn)
