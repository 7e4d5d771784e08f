"""A SQLAlchemy connection on the request's lent asyncpg connection, without a pool.

SQLAlchemy reaches a database through its pool: a checkout makes or reuses a DBAPI
connection, runs the dialect's on-connect setup on a new one (asyncpg's dialect sets json
and jsonb codecs on it), and a checkin resets it, closes it, or, when an async connection is
garbage collected unreturned, terminates it with a warning. None of that suits a connection
that is the store's, lent for one request: so no pool is involved. One engine per process
(`engine()`) holds the dialect and SQLAlchemy's compiled-statement cache; each session gets a
`Connection` built on a `Borrowed` connection, which SQLAlchemy releases by calling its
`close()`, and which does nothing then (the middleware ends the transaction and gives the
connection back). The dialect sets no codecs: JSON is decoded by SQLAlchemy's types instead,
so the connection decodes json and jsonb as asyncpg does by default, for the store and for
the next request that borrows it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import NullPool
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql import JSON, JSONB
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.types import JSON as GenericJSON
from sqlalchemy.util import greenlet_spawn

from ._lent_driver import LentConnection


class LentDialect(PGDialect_asyncpg):
    """asyncpg's dialect, decoding JSON itself. Its on-connect setup (the json and jsonb
    codecs) never runs: that is the pool's doing, and no pool is involved."""

    supports_statement_cache = True

    # No codec on the connection: SQLAlchemy's JSON types decode the text asyncpg returns
    # (SQLAlchemy 2.1 reads this flag; 2.0 decodes in the plain PostgreSQL types mapped
    # below instead of asyncpg's, which expect the codecs).
    supports_native_json_deserialization = False
    colspecs = {  # noqa: RUF012 (a class attribute of SQLAlchemy's, read by it)
        **PGDialect_asyncpg.colspecs,
        GenericJSON: JSON,
        JSON: JSON,
        JSONB: JSONB,
    }


registry.register("postgresql.idempotency_asgi", __name__, "LentDialect")


class Borrowed(PoolProxiedConnection):
    """What a SQLAlchemy `Connection` holds in place of a pooled connection: the dialect's
    adapter over a LentConnection. Releasing or invalidating it sends nothing."""

    def __init__(self, adapter: Any, lent: LentConnection) -> None:
        self.dbapi_connection = adapter
        self.driver_connection = lent
        self._adapter = adapter
        self._lent = lent
        self._valid = True

    @property
    def is_valid(self) -> bool:
        return self._valid

    @property
    def is_detached(self) -> bool:
        return False

    def detach(self) -> None:
        pass

    def close(self) -> None:
        self._lent.release()

    def invalidate(self, e: BaseException | None = None, soft: bool = False) -> None:
        # SQLAlchemy saw the connection fail (the database went away): the middleware
        # answers for the request's transaction; this session sends nothing more.
        self._valid = False
        self._lent.release()

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self._adapter.cursor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)


class Engine:
    """The process's one engine for sessions on lent connections, made on first use."""

    def __init__(self) -> None:
        self._engine: AsyncEngine | None = None
        self._initialized = False

    def get(self) -> AsyncEngine:
        if self._engine is None:
            # The pool is never used: connections come from `connect`, not from checkouts.
            self._engine = create_async_engine("postgresql+idempotency_asgi://", poolclass=NullPool)
        return self._engine

    async def connect(self, lent: LentConnection) -> AsyncConnection:
        """A SQLAlchemy connection whose statements run on `lent`, in the request's
        transaction (each transaction of its own a savepoint)."""
        engine = self.get()
        sync_engine = engine.sync_engine
        sync_conn = await greenlet_spawn(_connection, sync_engine, lent)
        connection = AsyncConnection(engine, sync_conn)
        if not self._initialized:
            # What a pool's first connect does: learn the server's version and defaults,
            # once, in a savepoint rolled back after (a request racing this one does it too).
            await connection.run_sync(_initialize)
            self._initialized = True
        return connection

    async def close(self, session: AsyncSession, bind: AsyncConnection) -> None:
        """Close a session and its connection (nothing is sent once its LentConnection is
        released), in one pass through SQLAlchemy's greenlet rather than one each."""
        await greenlet_spawn(_close, session.sync_session, bind.sync_connection)


def _close(session: Session, connection: Connection | None) -> None:
    session.close()
    if connection is not None:
        connection.close()


def _connection(sync_engine: Any, lent: LentConnection) -> Connection:
    """(In SQLAlchemy's greenlet.) The dialect's adapter over `lent`, made by the dialect's
    own connect, and a Connection holding it."""
    # `async_creator_fn` is how SQLAlchemy's own `create_async_engine(async_creator=...)`
    # reaches the asyncpg adapter's connect: a keyword of the dialect's DBAPI shim rather
    # than a documented parameter. A release that renames it fails every session test here
    # (TypeError at the first session), not silently.
    adapter = sync_engine.dialect.connect(async_creator_fn=_returning(lent))
    return Connection(sync_engine, connection=Borrowed(adapter, lent))


def _returning(lent: LentConnection) -> Callable[[], Coroutine[Any, Any, LentConnection]]:
    async def creator() -> LentConnection:
        return lent

    return creator


def _initialize(sync_conn: Connection) -> None:
    try:
        sync_conn.dialect.initialize(sync_conn)
    finally:
        sync_conn.rollback()  # the savepoint, and the Connection's own view: none begun
