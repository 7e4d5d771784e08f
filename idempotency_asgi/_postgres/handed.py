"""The request's connection as its handler holds it: the lent connection while the request's
transaction lasts, and nothing after.

A connection goes back to be lent again as soon as the request's transaction ends (its
record committed, or rolled back), which can be long before the handler's code is done: a
streamed answer commits when it starts, a background task runs after the answer. A handler
that kept the connection object and used it then would run its statements in another
request's transaction. So it holds this instead: everything it asks is the connection's own
until `detach()`, and then TransactionEnded. What the connection makes that runs statements
later (a prepared statement, a cursor, a transaction object for a savepoint) is held the
same way: usable while the connection is, TransactionEnded after.
"""

from __future__ import annotations

from typing import Any

from .._errors import ended


class HandedConnection:
    """An asyncpg connection, until detached (see the module)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def detach(self) -> None:
        self._conn = None

    def is_closed(self) -> bool:
        return self._conn is None or bool(self._conn.is_closed())

    def __getattr__(self, name: str) -> Any:
        conn = self._attached()
        if name in _MAKERS:
            return _Maker(self, getattr(conn, name))
        return getattr(conn, name)

    def _attached(self) -> Any:
        conn = self._conn
        if conn is None:
            raise ended()
        return conn

    def __repr__(self) -> str:
        state = "detached" if self._conn is None else repr(self._conn)
        return f"<request connection: {state}>"


#: The connection's methods that make an object which runs statements on it later.
_MAKERS = frozenset({"prepare", "cursor", "transaction"})


class _Maker:
    """One of the connection's `_MAKERS`: what it makes comes tied to the handed connection
    (awaited first where the maker is a coroutine function: `prepare`)."""

    __slots__ = ("_handed", "_make")

    def __init__(self, handed: HandedConnection, make: Any) -> None:
        self._handed = handed
        self._make = make

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        made = self._make(*args, **kwargs)
        if hasattr(made, "__await__") and not hasattr(made, "__aiter__"):
            return self._awaited(made)  # prepare(): a coroutine of a statement
        return _Tied(self._handed, made)

    async def _awaited(self, making: Any) -> Any:
        return _Tied(self._handed, await making)


class _Tied:
    """What a handed connection made, usable while the connection is attached."""

    __slots__ = ("_handed", "_made")

    def __init__(self, handed: HandedConnection, made: Any) -> None:
        self._handed = handed
        self._made = made

    def __getattr__(self, name: str) -> Any:
        self._handed._attached()
        if name in _MAKERS:  # a prepared statement's cursor(), say: tied the same way
            return _Maker(self._handed, getattr(self._made, name))
        return getattr(self._made, name)

    # What `async with`, `async for` and `await` look up on the type, not the instance.
    async def __aenter__(self) -> Any:
        self._handed._attached()
        return await self._made.__aenter__()

    async def __aexit__(self, *exc: Any) -> Any:
        self._handed._attached()
        return await self._made.__aexit__(*exc)

    def __aiter__(self) -> Any:
        self._handed._attached()
        return self._made.__aiter__()

    def __await__(self) -> Any:
        self._handed._attached()
        return self._made.__await__()

    def __repr__(self) -> str:
        return f"<{self._made!r} of the request's connection>"
