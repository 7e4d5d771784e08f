"""Connections: which database failures are an outage and which are for good, how a
connection whose statement timed out is made safe again, and the store's own small set of
connections for its one-statement calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from .._errors import CAUSE_LINKS, OutcomeUnknown, StoreError, StoreRefused, StoreUnavailable
from .deadlines import Deadlines

logger = logging.getLogger("idempotency_asgi")

T = TypeVar("T")

#: Failures that mean the connection itself is gone or unusable.
CONNECTION_LOST = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    # Seen when the server ends a session between two statements (a failover, a restart):
    # asyncpg's protocol is still busy with the server's farewell when the next query starts.
    asyncpg.exceptions.InternalClientError,
)

#: Failures that end the session: the connection is gone, or the server ended it (a shutdown,
#: a crash, an administrator). A statement cut short this way may or may not have taken
#: effect; an ERROR the server answered with means it did not.
SESSION_ENDED = (
    *CONNECTION_LOST,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
)

#: Everything the database or the driver can raise: what cleanup code suppresses.
DATABASE_ERRORS = (*CONNECTION_LOST, asyncio.TimeoutError, asyncpg.PostgresError)

#: SQLSTATE classes that pass: a connection exception (08), insufficient resources (53: too
#: many connections, a full disk, out of memory), operator intervention (57: a cancelled
#: statement, a shutdown, a server still starting), a system error (58: I/O) and a
#: transaction rolled back for a conflict (40: serialization failure, deadlock).
_PASSING_CLASSES = frozenset({"08", "53", "57", "58", "40"})

#: SQLSTATEs that pass too: a lock not obtained within lock_timeout, and a write refused by a
#: server that is (still, or for now) a read-only standby, as during a failover.
_PASSING_CODES = frozenset({"55P03", "25006"})


def server_answered(exc: BaseException) -> bool:
    """Whether `exc` is an error the server sent, on a connection that still serves (not
    the connection lost or closed, a timeout or a cancel)."""
    return isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, SESSION_ENDED)


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot answer now (unreachable, too slow, shutting
    down, short of resources), as opposed to refusing a statement for good. Only an outage
    is worth retrying; anything else PostgreSQL says would be said again."""
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):
        # An InterfaceError, like a lost connection, but about what the driver was given (a
        # URL or an option it cannot use): the same next time, so not worth a retry.
        return False
    if isinstance(exc, (*CONNECTION_LOST, asyncio.TimeoutError)):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        code = str(getattr(exc, "sqlstate", "") or "")
        return code[:2] in _PASSING_CLASSES or code in _PASSING_CODES
    return False


def database_error(exc: BaseException) -> asyncpg.PostgresError | None:
    """The error PostgreSQL answered with that `exc` is, or was raised from (`raise ... from`,
    a few links of `__cause__` deep); None when there is none, or when an OutcomeUnknown
    comes first: the application said what the error means (its effect may have happened),
    and that is what the request is settled by, whatever it was raised from."""
    link: BaseException | None = exc
    for _ in range(CAUSE_LINKS + 1):
        if link is None or isinstance(link, OutcomeUnknown):
            return None
        if isinstance(link, asyncpg.PostgresError):
            return link
        link = link.__cause__
    return None


def handler_failure(exc: BaseException) -> str | None:
    """What an exception a handler raised from its connection (or through a library on it,
    which raises its own error from asyncpg's: see `database_error`) says of the database:
    "outage" when the database, through the driver, says it is away or overloaded (the
    connection lost, the server shutting down or crashing, a statement cancelled for taking
    too long; never an OSError of the application's own, whose socket is not the database's),
    "conflict" for a serialization failure or a deadlock (the transaction lost to a
    concurrent one), None for anything else."""
    error = database_error(exc)
    if isinstance(error, asyncpg.exceptions.TransactionRollbackError):
        return "conflict"
    if error is not None and is_outage(error):
        return "outage"
    return None


def statement_cancelled(exc: BaseException) -> bool:
    """Whether `exc` is (or was raised from) a statement PostgreSQL cancelled: a cancel
    request (see stalls.py) or a statement_timeout."""
    return isinstance(database_error(exc), asyncpg.exceptions.QueryCanceledError)


def is_stall(exc: BaseException) -> bool:
    """Whether `exc`, met while connecting, says the database cannot be reached: a timeout,
    a connection refused or lost, a server shutting down or starting up, or out of
    connections. (A refusal, even one that passes, is an answer.)"""
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):
        return False  # the driver was given what it cannot use: see is_outage
    return isinstance(exc, (*SESSION_ENDED, asyncio.TimeoutError, *_NOT_ANSWERING))


_NOT_ANSWERING = (
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
)


def describe(exc: BaseException) -> str:
    """A refusal as operators and clients may read it: the error's class and SQLSTATE."""
    code = getattr(exc, "sqlstate", None)
    return f"{type(exc).__name__} ({code})" if code else type(exc).__name__


def classify(what: str, exc: BaseException) -> BaseException:
    """The exception to raise for `exc`, met while doing `what`: StoreUnavailable for an
    outage, StoreRefused for anything else PostgreSQL or the driver said; `exc` itself when
    it is not an Exception (a cancellation)."""
    if not isinstance(exc, Exception) or isinstance(exc, StoreError):
        return exc
    if is_outage(exc):
        return StoreUnavailable(f"{what}: {exc!r}")
    error = describe(exc)
    return StoreRefused(f"{what}: {error}: {exc}", error=error)


asyncio_timeout = getattr(asyncio, "timeout", None)


def time_left(deadline: float) -> float:
    """The seconds left until `deadline` (the running loop's clock), never quite none: a
    bound for the next step of something that must end by then."""
    return max(deadline - asyncio.get_running_loop().time(), 0.001)


async def bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """`await awaitable`, or asyncio.TimeoutError after `seconds` (the awaitable cancelled)."""
    if asyncio_timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio_timeout(seconds):
        return await awaitable


#: asyncpg.create_pool arguments that mean nothing to a single connection.
POOL_ONLY = frozenset(
    {
        "min_size",
        "max_size",
        "max_queries",
        "max_inactive_connection_lifetime",
        "setup",
        "init",
        "reset",
        "loop",
        "connection_class",
        "record_class",
        "connect",
    }
)


def discard(conn: Any) -> None:
    """Close a connection at once, never to be used again. One the pool already took back
    (its server closed it, and asyncpg returned it to the pool) is gone already."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


def is_closed(conn: Any) -> bool:
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        # The pool already took back a connection the server closed: it is gone.
        return True


async def settle(conn: Any, timeout: float) -> bool:
    """Make a connection whose statement was interrupted (a timeout, a cancelled request)
    safe again; True when it can be used again, False when it was closed.

    asyncpg answers an interrupted statement by sending PostgreSQL a cancel request on a
    connection of its own; the statement ends on the server only once that request lands.
    Closing the connection at once would drop the request, and the server would go on
    running (or waiting, for a lock or a standby) with nobody to tell it to stop: every
    timeout would leave one more busy backend behind. The next statement on the connection
    waits for the cancellation first, so a trivial one tells when it is over."""
    if is_closed(conn):
        return False
    try:
        await conn.execute("SELECT 1", timeout=timeout)
    except asyncio.CancelledError:
        discard(conn)
        raise
    except Exception:
        discard(conn)
        return False
    return True


class Statements:
    """A few connections for one-statement calls: a stack of idle ones and a first-in,
    first-out line of waiters. asyncpg's pool costs about 25 us of Python per acquire and
    release (a task for the release, a holder, a proxy); on the hot path that was a tenth of a
    replay's whole cost.

    A connection whose statement was interrupted keeps its place until `settle` says whether
    it can serve again: the store never has more backends than `size` working for it."""

    def __init__(
        self,
        connect: Callable[[float], Awaitable[Any]],
        size: int,
        timeout: float,
        deadlines: Deadlines | None = None,
    ) -> None:
        self._connect = connect
        self._size = size
        self._timeout = timeout
        # When given, a wait for a connection is bounded by the store's one timer rather
        # than a timer of its own (the lender's: under load most requests wait).
        self._deadlines = deadlines
        self._idle: list[Any] = []
        self._open = 0  # connected, connecting or settling
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._settling: set[asyncio.Task[None]] = set()
        self._closed = False

    async def acquire(self, timeout: float) -> Any:
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.is_closed():
                    return conn
                self._open -= 1
            if self._closed:
                raise StoreUnavailable("the key store is closed")
            if self._open < self._size:
                self._open += 1
                try:
                    return await self._connect(timeout)  # within the caller's time, all of it
                except BaseException:
                    self._open -= 1
                    self._hand_over(None)
                    raise
            waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                conn = await self._wait(waiter, timeout)
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    if waiter.result() is not None:
                        self.release(waiter.result())  # handed to us just as we gave up
                    else:
                        self._hand_over(None)  # pass the free slot on
                else:
                    waiter.cancel()
                raise
            if conn is not None:
                return conn
            # A connection died: its slot is free, so open one in its place (loop again).

    async def _wait(self, waiter: asyncio.Future[Any], timeout: float) -> Any:
        deadlines = self._deadlines
        if deadlines is None:
            return await bounded(asyncio.shield(waiter), timeout)

        def expire() -> None:
            if not waiter.done():
                waiter.set_exception(asyncio.TimeoutError())

        step = deadlines.start(expire, timeout)
        try:
            return await waiter
        finally:
            deadlines.end(step)

    def busy(self) -> bool:
        """Whether a connection would have to be waited for."""
        return not self._idle and self._open >= self._size

    def release(self, conn: Any) -> None:
        if conn.is_closed():
            self._open -= 1
            self._hand_over(None)
        elif self._closed:
            self._open -= 1
            discard(conn)
        else:
            self._hand_over(conn)

    def interrupted(self, conn: Any) -> None:
        """Give back a connection whose statement did not end normally: it serves again once
        its cancellation has landed, or is closed; its slot stays taken until then."""
        task = asyncio.ensure_future(self._settle(conn))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, conn: Any) -> None:
        try:
            if not await settle(conn, self._timeout):
                logger.debug("a statement connection was closed after an interrupted statement")
        finally:
            self.release(conn)

    def _hand_over(self, conn: Any) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        if conn is not None:
            self._idle.append(conn)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._settling):
            task.cancel()
        idle, self._idle = self._idle, []
        for conn in idle:
            self._open -= 1
            with contextlib.suppress(*DATABASE_ERRORS):
                await conn.close(timeout=2)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(StoreUnavailable("the key store is closed"))
