"""The request's connection as its handler holds it: the lent connection while the request's
transaction lasts, and nothing after.

A connection goes back to be lent again as soon as the request's transaction ends (its
record committed, or rolled back), which can be long before the handler's code is done: a
streamed answer commits when it starts, a background task runs after the answer. A handler
that kept the connection object and used it then would run its statements in another
request's transaction. So it holds this instead: everything it asks is the connection's own
until `detach()`, and then TransactionEnded.
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
        conn = self._conn
        if conn is None:
            raise ended()
        return getattr(conn, name)

    def __repr__(self) -> str:
        state = "detached" if self._conn is None else repr(self._conn)
        return f"<request connection: {state}>"
