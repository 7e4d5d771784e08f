"""A SQLAlchemy connection on the request's lent asyncpg connection, without a pool.

SQLAlchemy reaches a database through its pool: a checkout makes or reuses a DBAPI
connection, runs the dialect's on-connect setup on a new one (asyncpg's dialect sets json
and jsonb codecs on it), and a checkin resets it, closes it, or, when an async connection is
garbage collected unreturned, terminates it with a warning. None of that suits a connection
that is the store's, lent for one request: so no pool is involved. One `Engine` per process
holds the dialect and SQLAlchemy's compiled-statement cache; each session gets a `Connection`
built on a `Borrowed` connection (the dialect's adapter over a `LentConnection`), which
SQLAlchemy releases by calling its `close()`, and which sends nothing then (the middleware
ends the transaction and gives the connection back). The dialect sets no codecs: JSON is
decoded by SQLAlchemy's types instead, so the connection decodes json and jsonb as asyncpg
does by default, for the store and for the next request that borrows it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import NullPool
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql import JSON, JSONB
from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.types import JSON as GenericJSON
from sqlalchemy.util import greenlet_spawn

from .. import TransactionEnded
from .driver import SETTINGS_REFUSED, LentConnection

#: The asyncpg dialect's DBAPI adapter class (see `_adapter`); None where it is not there.
ADAPTER: Any = getattr(asyncpg_dialect, "AsyncAdapt_asyncpg_connection", None)


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

    def set_connection_execution_options(self, connection: Connection, opts: Any) -> None:
        # SQLAlchemy sets these on the driver's connection and resets them when its pool
        # takes the connection back: neither applies to the request's transaction, begun
        # already (and no pool is involved), so they are refused before anything is set.
        if TRANSACTION_SETTINGS.intersection(opts):
            raise TransactionEnded(SETTINGS_REFUSED)
        super().set_connection_execution_options(connection, opts)


#: The execution options (`session.connection(execution_options=...)`, a Connection's
#: `execution_options()`) that would set the transaction's characteristics.
TRANSACTION_SETTINGS = frozenset(
    {"isolation_level", "postgresql_readonly", "postgresql_deferrable"}
)


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
        # Held while the dialect learns the server (once): two first sessions at once, in
        # one request, would otherwise both send on its one connection.
        self._initializing: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

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
        adapter = _adapter(sync_engine.dialect, lent)
        if adapter is None:
            adapter = await greenlet_spawn(_connected, sync_engine.dialect, lent)
        sync_conn = Connection(sync_engine, connection=Borrowed(adapter, lent))
        connection = AsyncConnection(engine, sync_conn)
        if not self._initialized:
            async with self._lock():
                if not self._initialized:  # not done while this one waited
                    # What a pool's first connect does: learn the server's version and
                    # defaults, once, in a savepoint rolled back after.
                    await connection.run_sync(_initialize)
                    self._initialized = True
        return connection

    def _lock(self) -> asyncio.Lock:
        """The lock for the first initialization, in the running loop (a lock serves one
        loop; a process may run several, one after another, as tests do)."""
        loop = asyncio.get_running_loop()
        if self._initializing is None or self._initializing[0] is not loop:
            self._initializing = (loop, asyncio.Lock())
        return self._initializing[1]


def _adapter(dialect: Any, lent: LentConnection) -> Any:
    """The dialect's DBAPI adapter over `lent`, made directly: no I/O is needed to make one,
    and SQLAlchemy's own way (its connect) passes through its greenlet, whose switches cost
    more than everything else in making a session, under a deep ASGI stack. The class is
    the dialect's, not documented: None when it is not there or not made this way (the
    caller then takes SQLAlchemy's way, `_connected`)."""
    if ADAPTER is None:
        return None
    try:
        return ADAPTER(dialect.loaded_dbapi, lent)
    except TypeError:
        return None


def _connected(dialect: Any, lent: LentConnection) -> Any:
    """(In SQLAlchemy's greenlet.) The adapter made by the dialect's own connect."""
    # `async_creator_fn` is how SQLAlchemy's own `create_async_engine(async_creator=...)`
    # reaches the asyncpg adapter's connect: a keyword of the dialect's DBAPI shim rather
    # than a documented parameter.
    return dialect.connect(async_creator_fn=_returning(lent))


def _returning(lent: LentConnection) -> Callable[[], Coroutine[Any, Any, LentConnection]]:
    async def creator() -> LentConnection:
        return lent

    return creator


def _initialize(sync_conn: Connection) -> None:
    try:
        sync_conn.dialect.initialize(sync_conn)
    finally:
        sync_conn.rollback()  # the savepoint, and the Connection's own view: none begun
