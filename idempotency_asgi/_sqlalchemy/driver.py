"""What SQLAlchemy's asyncpg adapter is given in place of the request's connection.

SQLAlchemy's asyncpg dialect drives "a driver connection": it begins and ends transactions
with `transaction()`, prepares each statement and runs it, opens cursors, and, when it thinks
the connection is done with, closes or terminates it. Given the request's lent connection
as it is, any of that could reach the connection after the request's transaction has ended,
when the connection may already serve another request: a late ROLLBACK TO SAVEPOINT would
abort someone else's transaction, a `close()` would cut the store's pooled connection. So it
gets a `LentConnection` instead, which

- turns SQLAlchemy's transactions into savepoints inside the request's transaction (its
  `commit()` releases one, its `rollback()` returns to one), whatever asyncpg's own view;
- asks `connection(request)` before every round trip, so that once the request's
  transaction has ended nothing more is sent (TransactionEnded is raised instead);
- never closes, terminates or sets codecs on the connection: it is the store's.

Only the methods SQLAlchemy's adapter calls are here; anything else is refused by name, so
a SQLAlchemy release that starts calling another method fails loudly in the tests rather
than reaching the connection unguarded.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import asyncpg
from starlette.requests import HTTPConnection

# The package's public names, not its private modules: they may move.
from .. import TransactionEnded, connection

#: Savepoint names: unique per process, so that one never shadows another.
_names = itertools.count(1)

#: Why a session cannot set its transaction's isolation level, READ ONLY or DEFERRABLE: the
#: request's transaction began before the session existed, with the middleware's
#: isolation_level, and a savepoint cannot change it.
SETTINGS_REFUSED = (
    "a session in the request's transaction cannot set its isolation level, "
    "READ ONLY or DEFERRABLE: set isolation_level on the middleware instead"
)


class LentConnection:
    """The request's connection as SQLAlchemy's asyncpg adapter sees it (see the module)."""

    __slots__ = ("_conn", "_released", "_request")

    def __init__(self, conn: Any, request: HTTPConnection) -> None:
        self._conn = conn
        self._request = request
        # Set when the session is done with (closed): from then on its rollbacks are no-ops
        # and its statements refused, whatever the request's transaction does.
        self._released = False

    async def live(self) -> Any:
        """The connection, while the request's transaction is open and the session not
        released; TransactionEnded otherwise."""
        if self._released:
            raise TransactionEnded("the request's SQLAlchemy session is closed")
        conn = await connection(self._request)
        if conn is not self._conn:  # pragma: no cover - a request has one transaction
            raise TransactionEnded("the request's transaction is not the session's any more")
        return conn

    def ended(self) -> bool:
        """Whether nothing more may be sent (a rollback is then a no-op: the savepoint's fate
        was the request's transaction's)."""
        return self._released

    def release(self) -> None:
        """The session is done with: nothing it does afterwards reaches the connection."""
        self._released = True

    # -- what SQLAlchemy's asyncpg adapter calls ------------------------------------------

    def transaction(
        self, *, isolation: str | None = None, readonly: bool = False, deferrable: bool = False
    ) -> Savepoint:
        if isolation is not None or readonly or deferrable:
            raise TransactionEnded(SETTINGS_REFUSED)
        return Savepoint(self)

    async def prepare(
        self, query: str, *, name: str | None = None, timeout: float | None = None
    ) -> Statement:
        conn = await self.live()
        return Statement(self, await conn.prepare(query, name=name, timeout=timeout))

    async def executemany(
        self, command: str, args: Sequence[Sequence[Any]], *, timeout: float | None = None
    ) -> None:
        conn = await self.live()
        await conn.executemany(command, args, timeout=timeout)

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        conn = await self.live()  # SQLAlchemy's ping (pool_pre_ping) sends ";"
        return await conn.fetchrow(query, *args, timeout=timeout)

    async def reload_schema_state(self) -> None:
        conn = await self.live()
        await conn.reload_schema_state()

    def is_closed(self) -> bool:
        try:
            return bool(self._conn.is_closed())
        except asyncpg.InterfaceError:
            return True  # released to its pool: gone, as far as this session is concerned

    async def close(self, *, timeout: float | None = None) -> None:
        """Never closes the connection: it is the store's, and goes back to its pool."""

    def terminate(self) -> None:
        """Never terminates the connection (see close)."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"the request's connection lent to SQLAlchemy has no {name!r}: idempotency-asgi "
            "passes on only what SQLAlchemy's asyncpg dialect is known to use"
        )


class Savepoint:
    """SQLAlchemy's "transaction" on the request's connection: a savepoint, begun when the
    session first sends a statement; commit releases it, rollback returns to it."""

    __slots__ = ("_lent", "_name")

    def __init__(self, lent: LentConnection) -> None:
        self._lent = lent
        self._name: str | None = None

    async def start(self) -> None:
        conn = await self._lent.live()
        name = f"idempotency_asgi_session_{next(_names)}"
        await conn.execute(f"SAVEPOINT {name}")
        self._name = name

    async def commit(self) -> None:
        conn = await self._lent.live()  # a commit after the request's end must not pass
        if self._name is not None:
            name, self._name = self._name, None
            await conn.execute(f"RELEASE SAVEPOINT {name}")

    async def rollback(self) -> None:
        if self._name is None or self._lent.ended():
            return
        try:
            conn = await self._lent.live()
        except TransactionEnded:
            # The request's transaction ended (committed with its record, or rolled back):
            # the savepoint went with it, and the connection may serve someone else now.
            return
        name, self._name = self._name, None
        # One round trip; RELEASE too, so that savepoints never pile up in a long request.
        await conn.execute(f"ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}")


class Statement:
    """A prepared statement whose round trips ask the request's transaction first."""

    __slots__ = ("_lent", "_statement")

    def __init__(self, lent: LentConnection, statement: Any) -> None:
        self._lent = lent
        self._statement = statement

    def get_attributes(self) -> Any:
        return self._statement.get_attributes()

    def get_statusmsg(self) -> Any:
        return self._statement.get_statusmsg()

    async def fetch(self, *args: Any, timeout: float | None = None) -> list[Any]:
        await self._lent.live()
        rows: list[Any] = await self._statement.fetch(*args, timeout=timeout)
        return rows

    async def cursor(self, *args: Any) -> Cursor:
        await self._lent.live()
        return Cursor(self._lent, await self._statement.cursor(*args))


class Cursor:
    """A server-side cursor (`stream()`, `yield_per`), guarded the same way."""

    __slots__ = ("_cursor", "_lent")

    def __init__(self, lent: LentConnection, cursor: Any) -> None:
        self._lent = lent
        self._cursor = cursor

    async def fetch(self, n: int, *, timeout: float | None = None) -> list[Any]:
        await self._lent.live()
        rows: list[Any] = await self._cursor.fetch(n, timeout=timeout)
        return rows
