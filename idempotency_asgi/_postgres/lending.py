"""Lending connections to handlers' transactions (the transactional and atomic modes).

With a DSN the store lends connections of its own, kept without asyncpg's pool machinery (a
stack of idle ones and a first-in, first-out line of waiters, see connections.Statements:
no task, holder or proxy per loan, and no reset round trip of the pool's: a lent
connection's reset rides on its COMMIT). With a pool of the application's, handlers borrow
from that pool behind a first-in, first-out gate. A connection lent to a handler
has its session reset before anyone else gets it; its transaction begins, commits and rolls
back within the store's `timeout`; a connection whose step ran out of time is never handed
out again.

A COMMIT is bounded without being cancelled. Cancelling a COMMIT that waits for a
synchronous standby does not undo it: PostgreSQL keeps the commit on the primary alone (it
warns so) and shows it to everyone at once. The client would have its 503 while retries were
answered from a record the standby never got, and the next failover would lose an answer
clients had seen. So a COMMIT that outlives the timeout answers its request with a 503 and
goes on in the background, holding its connection, and its place in the pool, until
PostgreSQL decides: committed (a retry gets the replay), rolled back (the key is freed), or
the connection lost (the key is left to its lease). The connection is closed after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from .._errors import CommitPending, StoreUnavailable
from . import sql
from .asyncpg_transactions import begin_with, commit_with, rollback_with
from .connections import (
    DATABASE_ERRORS,
    SESSION_ENDED,
    Statements,
    bounded,
    classify,
    discard,
    is_closed,
)
from .deadlines import Deadlines, Step
from .sql import onecommit as short_sql

logger = logging.getLogger("idempotency_asgi")


class Lender:
    """The pool handlers' transactions run on, and the gate in front of it.

    It never opens the store's breaker (see outages.py): a handler's slow COMMIT, a pool the
    handlers drained, are that request's own trouble, not the database stuck."""

    def __init__(self, *, timeout: float, deadlines: Deadlines) -> None:
        self._timeout = timeout
        #: the store's one timer (deadlines.py): a request's BEGIN and COMMIT are bounded by
        #: it, not by a timer of their own each
        self._deadlines = deadlines
        self._pool: asyncpg.Pool | None = None
        self._own: Statements | None = None
        self._gate: asyncio.Semaphore | None = None
        # Connections out, by id: where each must go back to (the pool and the gate permit,
        # or the store's own connections), exactly once, however many times give_back() is
        # called for it.
        self._out: dict[int, tuple[asyncpg.Pool, asyncio.Semaphore] | Statements] = {}
        # Server pids of lent connections whose session has not been reset yet, and the
        # store's locks their reset lets go of first (see `must_reset`).
        self._lent: dict[int, tuple[int, ...]] = {}
        self._late: set[asyncio.Task[None]] = set()

    def attach(self, pool: asyncpg.Pool) -> None:
        """Lend from a pool of the application's."""
        self._pool = pool
        self._gate = asyncio.Semaphore(pool.get_max_size())

    def own(self, connections: Statements) -> None:
        """Lend the store's own connections (a DSN's)."""
        self._own = connections

    @property
    def pool(self) -> asyncpg.Pool | None:
        """The application's pool lent from, if that is where connections come from."""
        return self._pool

    @property
    def opened(self) -> bool:
        return self._pool is not None or self._own is not None

    def busy(self) -> bool:
        """Whether a connection would have to be waited for (every one is lent)."""
        if self._own is not None:
            return self._own.busy()
        return self._gate is None or self._gate.locked()

    async def close(self) -> None:
        """Stop waiting for late commits (their connections are closed; on the server they
        finish as PostgreSQL decides), then close the pool if it is the store's own."""
        for task in list(self._late):
            task.cancel()
        for task in list(self._late):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        own, self._own = self._own, None
        self._pool, self._gate = None, None
        if own is not None:
            # Idle ones are closed now, lent ones as they come back (nobody waits for a
            # handler to finish).
            await own.close()

    async def lend(self, timeout: float | None = None, *, reset: bool = True) -> Any:
        """A pooled connection for code other than the store's (a handler's transaction):
        its session is reset before the pool hands it to anyone else. `reset=False`: not
        yet, the store's own statements run on it first (see `must_reset`)."""
        conn = await self.acquire(timeout)
        if reset:
            self._lent[conn.get_server_pid()] = ()
        return conn

    def must_reset(self, conn: Any, *locks: int) -> None:
        """The session of a lent connection changed (it holds locks of the store's, a
        handler is about to have it): reset it before the pool hands it to anyone else.
        `locks`: the session's locks its reset lets go of first, in that order, in the
        reset's first statement (see sql.reset_unlocking)."""
        self._lent[conn.get_server_pid()] = locks

    async def acquire(self, timeout: float | None = None) -> Any:
        """A pooled connection, within `timeout` (the store's by default); `give_back`
        returns it."""
        timeout = self._timeout if timeout is None else timeout
        own = self._own
        if own is not None:
            try:
                conn = await own.acquire(timeout)
            except asyncio.TimeoutError as exc:
                raise StoreUnavailable("no free connection to the key store in time") from exc
            except BaseException as exc:
                raise classify("no connection to the key store", exc) from exc
            self._out[id(conn)] = own
            return conn
        pool, gate = self._pool, self._gate
        if pool is None or gate is None:
            raise StoreUnavailable("the key store is closed")
        try:
            # First in, first served. asyncpg's pool queue lets a newcomer take a connection
            # that was just handed to a waiter, and under load the waiters that lose that race
            # again and again made a p99 several times the p50. The gate is a FIFO semaphore
            # sized to the pool, so the pool itself never makes anyone wait.
            if not gate.locked():
                await gate.acquire()
            else:
                await bounded(gate.acquire(), timeout)
        except asyncio.TimeoutError as exc:
            raise StoreUnavailable("no free connection to the key store in time") from exc
        try:
            # A pool shared with the application may be drained by it: bound the wait.
            conn = await pool.acquire(timeout=max(timeout, 0.001))
        except BaseException as exc:
            gate.release()
            raise classify("no connection to the key store", exc) from exc
        self._out[id(conn)] = (pool, gate)
        return conn

    async def begin(self, conn: Any, isolation: str | None = None, run: int = 0) -> Any:
        """Start a transaction on a lent connection (at `isolation`, one of
        _config.ISOLATION_LEVELS; None: the database's default), within the timeout, with
        the run's marks (see sql/onecommit.marked), in one round trip; a connection that
        could not is given back closed."""
        marked = short_sql.marked(run)
        deadlines = self._deadlines
        step: Step | None = None
        try:
            # Late: the connection is closed under the BEGIN, which then fails at once (the
            # server rolls back whatever a closed connection left open).
            step = deadlines.start(lambda: discard(conn))
            begun = await begin_with(conn, f"{short_sql.BEGINS[isolation]}; {marked}")
            if begun is not None:
                tx = begun[0]
            else:
                # This asyncpg does not let a BEGIN of ours stand for its own: the ordinary way.
                tx = conn.transaction(
                    isolation=None if isolation is None else isolation.replace(" ", "_")
                )
                await tx.start()
                await conn.execute(marked)
        except BaseException as exc:
            if step is not None:
                deadlines.end(step)
            discard(conn)
            await self.give_back(conn)
            if step is not None and step.expired and isinstance(exc, Exception):
                raise self._late_begin() from exc
            raise classify("cannot begin a transaction", exc) from exc
        deadlines.end(step)
        if step.expired:
            # Answered as the timer went off: its connection was closed all the same.
            await self.give_back(conn)
            raise self._late_begin()
        return tx

    def _late_begin(self) -> StoreUnavailable:
        return StoreUnavailable(f"the BEGIN did not finish within {self._deadlines.timeout:g} s")

    async def commit(
        self,
        conn: Any,
        tx: Any,
        *,
        timeout: float,
        if_rolled_back: Callable[[], Awaitable[None]],
        if_committed: Callable[[], Awaitable[None]] | None = None,
        first: str = "",
    ) -> None:
        """Commit within `timeout`, or raise CommitPending and let the COMMIT go on (see
        the module's docstring); `if_rolled_back` runs if it then fails, `if_committed` if it
        then lands. `first`: statements (ending with `; `) run before the COMMIT in its round
        trip (the two-phase completion).
        Errors of a COMMIT that ended in time are asyncpg's own, for the caller to tell whose
        they are."""
        # The caller waits on a future of its own, ended by the COMMIT or by the store's timer,
        # whichever comes first: a cancelled caller, or one the timer lets go, leaves the
        # COMMIT running (no shield, no timer of its own). Bounded before it starts.
        waiting = asyncio.get_running_loop().create_future()

        def ended(_: object = None) -> None:
            if not waiting.done():
                waiting.set_result(None)

        deadlines = self._deadlines
        step = deadlines.start(ended, max(timeout, 0.0))
        committing = asyncio.ensure_future(self._commit(conn, tx, first))
        committing.add_done_callback(ended)
        try:
            await waiting
        except asyncio.CancelledError:
            deadlines.end(step)
            if not committing.done():
                committing.remove_done_callback(ended)
                self._finish_late(conn, committing, if_rolled_back, if_committed)
            elif not committing.cancelled():
                committing.exception()  # ended as its caller was cancelled: seen, not raised
            raise
        deadlines.end(step)
        if not committing.done():
            committing.remove_done_callback(ended)
            self._finish_late(conn, committing, if_rolled_back, if_committed)
            raise CommitPending(
                f"the COMMIT did not finish within {timeout:.2g} s; it goes on in the "
                "background, and a retry is answered with its record if it lands"
            )
        committing.result()  # what it raised, if it failed

    async def _commit(self, conn: Any, tx: Any, before: str = "") -> None:
        # With the session reset that giving the connection back would cost, in the same
        # round trip. COMMIT first, so it runs with the handler's settings (a `SET LOCAL
        # synchronous_commit`, what deferred triggers read). If it fails the server skips the
        # rest and the release resets the session as usual. What follows a COMMIT that
        # succeeded cannot fail short of a cancel or a lost connection, and then the key row,
        # committed, is the answer.
        pid = conn.get_server_pid()
        locks = self._lent.get(pid, ())
        if await commit_with(tx, f"{before}COMMIT; {sql.reset_unlocking(*locks)}"):
            self._lent.pop(pid, None)
        else:
            if before:
                await conn.execute(before)
            await tx.commit()

    def _finish_late(
        self,
        conn: Any,
        committing: asyncio.Future[None],
        if_rolled_back: Callable[[], Awaitable[None]],
        if_committed: Callable[[], Awaitable[None]] | None,
    ) -> None:
        # From here on the connection is the late commit's: give_back() ignores it, so the
        # request that gave up waiting cannot hand it to anyone while the COMMIT runs.
        taken = self._out.pop(id(conn), None)
        task = asyncio.ensure_future(
            self._late_outcome(conn, taken, committing, if_rolled_back, if_committed)
        )
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def _late_outcome(
        self,
        conn: Any,
        taken: tuple[asyncpg.Pool, asyncio.Semaphore] | Statements | None,
        committing: asyncio.Future[None],
        if_rolled_back: Callable[[], Awaitable[None]],
        if_committed: Callable[[], Awaitable[None]] | None,
    ) -> None:
        started = asyncio.get_running_loop().time()
        rolled_back = committed = False
        try:
            # Shielded: close() stops this wait, never the COMMIT (a cancel sent to the server
            # would keep it on the primary alone under synchronous replication).
            await asyncio.shield(committing)
        except SESSION_ENDED as exc:
            logger.warning(
                "a COMMIT that outlived the timeout lost its connection; whether it landed "
                "is unknown, so its key is left to its lease: %r",
                exc,
            )
        except asyncpg.PostgresError as exc:
            logger.warning("a COMMIT that outlived the timeout failed: rolled back: %r", exc)
            rolled_back = True
        except Exception as exc:
            logger.warning("a COMMIT that outlived the timeout ended unknown: %r", exc)
        else:
            committed = True
            logger.warning(
                "a COMMIT that outlived the timeout landed %.1f s later: its record is "
                "committed, and retries get its replay",
                asyncio.get_running_loop().time() - started,
            )
        finally:
            discard(conn)  # never handed out again
            if taken is not None:
                self._out[id(conn)] = taken
                await self.give_back(conn)
        if rolled_back:
            await if_rolled_back()  # with the connection and its permit given back
        elif committed and if_committed is not None:
            await if_committed()

    async def rollback(
        self, conn: Any, tx: Any, *, then: bool = False, check: str | None = None
    ) -> bool:
        """Roll back within the timeout; a connection that could not is closed (the server
        rolls back what a closed connection left open). `then`: with the locks `must_reset`
        recorded let go of (sql.release_locks) in the same round trip, the reset left to
        `give_back`, for a connection given back next: behind a pooler in transaction mode, the
        round trip after a ROLLBACK may reach another server connection than the one the
        lock is on. `check`: a statement after the ROLLBACK, in its round trip, that raises
        IA001 when the handler had committed the transaction itself (see
        sql/onecommit.rolled_back); True then."""
        if is_closed(conn):
            return False
        unlocks = sql.release_locks(*self._lent.get(conn.get_server_pid(), ())) if then else ""
        after = f"{check}{unlocks}" if check else unlocks
        try:
            if after:
                done = await bounded(rollback_with(tx, f"ROLLBACK; {after}"), self._timeout)
                if done:
                    if unlocks:
                        self._lent[conn.get_server_pid()] = ()
                    return False
            await bounded(tx.rollback(), self._timeout)
        except asyncio.CancelledError:
            discard(conn)
            raise
        except asyncpg.PostgresError as exc:
            if getattr(exc, "sqlstate", None) == short_sql.ENDED:
                return True  # rolled back: the connection is fine
            discard(conn)
        except Exception:
            discard(conn)
        return False

    async def reset(self, conn: Any) -> None:
        """The pool's reset. The default is a round trip on every release; the store's own
        statements leave no session state, so only connections lent to a handler pay."""
        pid = conn.get_server_pid()
        locks = self._lent.pop(pid, None)
        if locks is not None:
            await conn.execute(sql.reset_unlocking(*locks), timeout=self._timeout)

    async def give_back(self, conn: Any) -> None:
        """Return a connection from `lend()` to where it came from (and its permit to the
        gate). A connection already given back is ignored, so a second call can never hand
        out more connections than there are."""
        taken = self._out.pop(id(conn), None)
        if taken is None:
            return
        pid = _pid(conn)
        if not is_closed(conn) and conn.is_in_transaction():
            discard(conn)  # never handed to anyone in a transaction of somebody else's
        try:
            if not is_closed(conn):
                # Reset what a handler may have left (a role, settings, temporary tables...)
                # unless its COMMIT's round trip did. A connection that cannot be reset (or
                # whose reset was cancelled) is not handed to anyone again.
                try:
                    await self.reset(conn)
                except BaseException as exc:
                    discard(conn)
                    if not isinstance(exc, DATABASE_ERRORS):
                        raise
        finally:
            if pid is not None:
                self._lent.pop(pid, None)  # one closed before its reset has none to do
            if isinstance(taken, Statements):
                taken.release(conn)  # a closed one frees its place for a new one
            else:
                pool, gate = taken
                try:
                    # Back to its pool whatever happened (the pool terminates a connection
                    # it cannot reset; nothing is lost).
                    with contextlib.suppress(*DATABASE_ERRORS):
                        await pool.release(conn, timeout=self._timeout)
                finally:
                    gate.release()


def _pid(conn: Any) -> int | None:
    try:
        return int(conn.get_server_pid())
    except (asyncpg.InterfaceError, AttributeError, TypeError):
        return None
