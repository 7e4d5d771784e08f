"""The request's business transaction, committed together with its key record (the
transactional mode: two phases, the claim committed first). The store lends it; the
middleware ends it. `commit_record` is how every mode's transaction writes its record and
commits (see atomic.py for the one-transaction mode)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any, Protocol

import asyncpg

from .. import _callbacks as callbacks
from .._errors import (
    HandlerEndedTransaction,
    StoreError,
    StoreUnavailable,
    TransactionFailed,
    ended,
)
from .._records import Lease, StoredResponse
from .claiming import new_token
from .connections import (
    SESSION_ENDED,
    bounded,
    classify,
    discard,
    handler_failure,
    is_closed,
    statement_cancelled,
)
from .handed import HandedConnection
from .sql import onecommit as short_sql
from .stalls import Watch


class Lending(Protocol):
    """What a transaction needs from its store: connections lent within a timeout, and the
    completion written inside the transaction (PostgresStore is one)."""

    timeout: float

    async def lend(self) -> Any: ...

    async def begin(self, conn: Any, isolation: str | None = None, run: int = 0) -> Any: ...

    def watch(self, conn: Any, seconds: float) -> Watch | None: ...

    def unwatch(self, watch: Watch | None) -> None: ...

    def completion(
        self, lease: Lease, response: StoredResponse, expires_us: int, run: int
    ) -> str | None: ...

    async def complete(
        self,
        lease: Lease,
        response: StoredResponse,
        *,
        ttl_seconds: float,
        conn: Any = None,
        timeout: float | None = None,
    ) -> datetime | None: ...

    async def commit(
        self,
        conn: Any,
        tx: Any,
        lease: Lease,
        *,
        timeout: float,
        first: str = "",
        if_committed: Callable[[], Awaitable[None]] | None = None,
    ) -> None: ...

    async def rollback(self, conn: Any, tx: Any, run: int | None = None) -> bool: ...

    async def give_back(self, conn: Any) -> None: ...


async def commit_record(
    conn: Any,
    *,
    timeout: float,
    write: Callable[[float], Awaitable[datetime | None]],
    commit: Callable[[float], Awaitable[None]],
) -> datetime | None:
    """Write the record inside the transaction of `conn` (`write(timeout)`), then commit
    (`commit(time left)`), within `timeout` in all: the answer is due within it.

    Returns when the record expires; None when `write` found the key no longer this
    request's (the caller then rolls back). Raises StoreUnavailable when the database failed
    or was too slow (CommitPending when the COMMIT itself outlived the timeout and goes on),
    TransactionFailed when a statement of the application's left the transaction unable to
    commit.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        try:
            written = await write(timeout)
        except asyncpg.PostgresError as exc:
            if not isinstance(exc, _THE_TRANSACTIONS) and not is_closed(conn):
                # The record's own statement refused for good (a permission the role lacks,
                # a value it cannot store), in a transaction the application left usable:
                # the store's failure, not the application's.
                raise classify("the record could not be written", exc) from exc
            raise
        if written is not None:
            await commit(deadline - loop.time())
        return written
    except StoreError:
        raise
    except asyncpg.PostgresError as exc:
        # If the connection broke after COMMIT reached the server, the transaction may
        # have committed after all; then the key row holds the response and the client's
        # retry is answered with its replay. Either way, both or neither.
        if is_closed(conn) or isinstance(exc, _SLOW_OR_LOST):
            raise StoreUnavailable(f"the transaction's database failed: {exc!r}") from exc
        raise TransactionFailed(
            f"the request's transaction could not commit: {exc!r}",
            transient=isinstance(exc, asyncpg.exceptions.TransactionRollbackError),
            read_only=isinstance(exc, asyncpg.exceptions.ReadOnlySQLTransactionError),
        ) from exc
    except Exception as exc:
        raise classify("the transaction's database failed", exc) from exc


class Transaction:
    """One request's business transaction, committed together with its key record.

    Nothing is acquired until `connection()` is first awaited; a request whose handler never
    asks for it completes its key with a single autocommit statement instead. It ends with the
    response in both modes (`complete()` or `close()`); after that, `connection()` raises.
    One lock orders `connection()`, `complete()` and `close()`, so a connection being opened
    while the response ends is either part of the ending or never handed out.
    """

    #: what an exception of the handler's says of the database (see connections.py)
    failure = staticmethod(handler_failure)
    cancelled = staticmethod(statement_cancelled)

    def __init__(
        self, store: Lending, isolation: str | None = None, idle_seconds: float = 0.0
    ) -> None:
        self._store = store
        self._isolation = isolation
        self.idle_seconds = idle_seconds
        #: the watch for sessions that wait on it while it sits idle (see stalls.py)
        self._watch: Watch | None = None
        #: the run's mark (see sql/onecommit.marked)
        self._run = new_token()
        self._conn: Any = None
        self._handed: HandedConnection | None = None
        self._tx: Any = None
        self._ended = False
        #: found when it rolled back: the handler had committed it itself
        self._committed_by_handler = False
        self._lock = asyncio.Lock()
        #: whether a handler asked for the connection (the request is in transactional mode)
        self.used = False
        #: what runs once it has committed (see _asgi/aftercommit.py)
        self.on_commit: list[Callable[[], Any]] = []

    async def connection(self) -> Any:
        async with self._lock:
            if self._ended:
                raise ended()
            if self._conn is None:
                conn = await self._store.lend()
                # gives the connection back if it fails
                tx = await self._store.begin(conn, self._isolation, self._run)
                self._conn, self._tx, self.used = conn, tx, True
                self._handed = HandedConnection(conn)
                self._watch = self._store.watch(conn, self.idle_seconds)
            assert self._handed is not None
            return self._handed

    def ended_by_handler(self) -> bool:
        """Whether the handler ended the transaction itself: it is not in one now, or our
        ROLLBACK found that the handler had committed it (a COMMIT and a BEGIN of its own)."""
        conn = self._conn
        return self._committed_by_handler or (
            conn is not None
            and self._tx is not None
            and not is_closed(conn)
            and not conn.is_in_transaction()
        )

    @property
    def stalled(self) -> bool:
        """Whether a session that waited on the transaction while it sat idle was cancelled
        (see stalls.py)."""
        return self._watch is not None and self._watch.stalled

    def broken(self) -> bool:
        """Whether the transaction's connection is gone (the database failed under it)."""
        return self._conn is not None and is_closed(self._conn)

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Record the response and commit the business writes with it, atomically; the
        transaction has ended when this returns or raises (see `commit_record`). None when
        the lease was lost (and everything rolled back)."""
        store = self._store
        async with self._lock:
            self._ended = True
            conn, tx = self._conn, self._tx
            if conn is None:
                return await store.complete(lease, response, ttl_seconds=ttl_seconds)
            if not conn.is_in_transaction():
                # Written now, the record would commit on its own, outside the writes it
                # speaks of (which the handler committed, or rolled back).
                self._tx = None
                await self._end()
                raise HandlerEndedTransaction(
                    "the handler ended the request's transaction itself (a COMMIT or a "
                    "ROLLBACK on the request's connection): its writes may or may not have "
                    "been committed"
                )

            expires_us = round((time.time() + ttl_seconds) * 1_000_000)
            first = store.completion(lease, response, expires_us, self._run)
            if first is not None:
                try:
                    return await self._complete_in_commit(conn, tx, lease, first, expires_us)
                finally:
                    await self._end()

            def write(timeout: float) -> Awaitable[datetime | None]:
                return store.complete(
                    lease, response, ttl_seconds=ttl_seconds, conn=conn, timeout=timeout
                )

            async def commit(timeout: float) -> None:
                self._tx = None
                await store.commit(
                    conn, tx, lease, timeout=timeout, if_committed=self._committed_late
                )

            try:
                return await commit_record(conn, timeout=store.timeout, write=write, commit=commit)
            finally:
                await self._end()

    async def _complete_in_commit(
        self, conn: Any, tx: Any, lease: Lease, first: str, expires_us: int
    ) -> datetime | None:
        """The completion and the COMMIT in one round trip (see sql/onecommit.complete):
        when the record expires, None when the lease was lost (rolled back). Raises as
        `commit_record` does, and HandlerEndedTransaction when the transaction is not the one
        the lender began any more."""
        store = self._store
        self._tx = None
        try:
            await store.commit(
                conn,
                tx,
                lease,
                timeout=store.timeout,
                first=first,
                if_committed=self._committed_late,
            )
        except asyncpg.PostgresError as exc:
            code = getattr(exc, "sqlstate", None)
            if code in (short_sql.LOST, short_sql.ENDED, *_ABORTED) and not is_closed(conn):
                # The completion refused, or a statement of the application's left the
                # transaction aborted: the COMMIT was skipped, and it is rolled back here.
                await self._roll_back(conn)
            if code == short_sql.LOST:
                return None
            if code == short_sql.ENDED:
                raise HandlerEndedTransaction(
                    "the handler ended the request's transaction itself (a COMMIT or a "
                    "ROLLBACK on the request's connection, then a BEGIN): what it wrote "
                    "before may have been committed"
                ) from exc
            if is_closed(conn) or isinstance(exc, _SLOW_OR_LOST):
                raise StoreUnavailable(f"the transaction's database failed: {exc!r}") from exc
            if isinstance(exc, _THE_TRANSACTIONS) or str(code)[:2] in ("23", "25", "40"):
                raise TransactionFailed(
                    f"the request's transaction could not commit: {exc!r}",
                    transient=isinstance(exc, asyncpg.exceptions.TransactionRollbackError),
                    read_only=isinstance(exc, asyncpg.exceptions.ReadOnlySQLTransactionError),
                ) from exc
            raise classify("the record could not be written", exc) from exc
        except StoreError:
            raise
        except Exception as exc:
            raise classify("the transaction's database failed", exc) from exc
        return datetime.fromtimestamp(expires_us / 1_000_000, timezone.utc)

    async def _committed_late(self) -> None:
        """The COMMIT that outlived the timeout (its client was answered 503) landed: what
        the handler scheduled for after it runs now, as it would have then."""
        await callbacks.run(self.on_commit)

    async def _roll_back(self, conn: Any) -> None:
        try:
            await bounded(conn.execute("ROLLBACK"), self._store.timeout)
        except BaseException:
            discard(conn)
            raise

    async def close(self) -> None:
        """End the transaction: roll back whatever is still open and give the connection
        back. Safe to call more than once."""
        async with self._lock:
            self._ended = True
            await self._end()

    async def _end(self) -> None:
        conn, tx = self._conn, self._tx
        self._conn = self._tx = None
        if self._handed is not None:
            self._handed.detach()  # from here on the handler's statements reach nothing
        if conn is None:
            return
        self._store.unwatch(self._watch)
        try:
            # Bounded; closes what cannot roll back.
            if tx is not None and await self._store.rollback(conn, tx, self._run):
                self._committed_by_handler = True
        finally:
            await self._store.give_back(conn)


#: What the record's statement meets because of the transaction it runs in, not because of
#: itself: a transaction the application aborted (it caught an error and carried on), a
#: conflict with a concurrent one, READ ONLY, or the database slow or gone.
_THE_TRANSACTIONS = (
    asyncpg.exceptions.InFailedSQLTransactionError,
    asyncpg.exceptions.TransactionRollbackError,
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    asyncpg.exceptions.QueryCanceledError,
    *SESSION_ENDED,
)

#: SQLSTATEs of a transaction left aborted by the application: the completion before the
#: COMMIT fails on them, and the COMMIT is skipped.
_ABORTED = ("25P02",)

#: Statement failures that are the database being slow or going away, not the application:
#: a cancelled statement (statement_timeout) and the server ending the session.
_SLOW_OR_LOST = (*SESSION_ENDED, asyncpg.exceptions.QueryCanceledError)
