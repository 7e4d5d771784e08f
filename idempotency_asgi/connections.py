"""Connections: what counts as the store being unavailable, and the store's own small set of
connections for its one-statement calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

#: Failures that mean the connection itself is gone or unusable.
CONNECTION_LOST = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    # Seen when the server ends a session between two statements (a failover, a restart):
    # asyncpg's protocol is still busy with the server's farewell when the next query starts.
    asyncpg.exceptions.InternalClientError,
)

#: Failures that mean "the store cannot answer now". Every PostgresError is here too: a missing
#: table or a permission error is as much a reason to fail closed as a dead server.
UNAVAILABLE = (*CONNECTION_LOST, asyncio.TimeoutError, asyncpg.PostgresError)

asyncio_timeout = getattr(asyncio, "timeout", None)

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


async def commit_with(tx: Any, statements: str) -> bool:
    """Commit asyncpg transaction `tx` by running `statements` (a simple-query string that
    starts with COMMIT) in one round trip, keeping asyncpg's own view of the transaction right:
    afterwards `tx` is committed (or failed) as if `tx.commit()` had run.

    False, having run nothing, when `tx` is not a plain top-level transaction this asyncpg
    version lets us finish that way (the caller then commits it the ordinary way)."""
    state: Any = getattr(asyncpg.transaction, "TransactionState", None)
    conn: Any = getattr(tx, "_connection", None)
    if (
        state is None
        or conn is None
        or id(getattr(conn, "_top_xact", None)) != id(tx)
        or getattr(tx, "_nested", True)
        or getattr(tx, "_state", None) is not state.STARTED
    ):
        return False
    conn._top_xact = None
    try:
        await conn.execute(statements)
    except BaseException:
        tx._state = state.FAILED
        raise
    tx._state = state.COMMITTED
    return True


def is_closed(conn: Any) -> bool:
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        # The pool already took back a connection the server closed: it is gone.
        return True


class Statements:
    """A few connections for one-statement calls: a stack of idle ones and a first-in,
    first-out line of waiters. asyncpg's pool costs about 25 us of Python per acquire and
    release (a task for the release, a holder, a proxy); on the hot path that was a tenth of a
    replay's whole cost."""

    def __init__(self, connect: Callable[[], Awaitable[Any]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[Any] = []
        self._open = 0  # connected or connecting
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._closed = False

    async def acquire(self, timeout: float) -> Any:
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.is_closed():
                    return conn
                self._open -= 1
            if self._closed:
                raise asyncpg.InterfaceError("the key store is closed")
            if self._open < self._size:
                self._open += 1
                try:
                    return await self._connect()
                except BaseException:
                    self._open -= 1
                    self._hand_over(None)
                    raise
            waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                if asyncio_timeout is None:  # Python 3.10
                    conn = await asyncio.wait_for(asyncio.shield(waiter), timeout)
                else:
                    async with asyncio_timeout(timeout):
                        conn = await waiter
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

    def release(self, conn: Any) -> None:
        if conn.is_closed():
            self._open -= 1
            self._hand_over(None)
        elif self._closed:
            self._open -= 1
            conn.terminate()
        else:
            self._hand_over(conn)

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
        idle, self._idle = self._idle, []
        for conn in idle:
            self._open -= 1
            with contextlib.suppress(*UNAVAILABLE):
                await conn.close(timeout=2)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(asyncpg.InterfaceError("the key store is closed"))
