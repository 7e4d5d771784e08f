"""The request's business transaction, committed together with its key record (the
transactional mode). The store lends it; the middleware ends it."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .connections import CONNECTION_LOST, UNAVAILABLE, is_closed
from .errors import StoreUnavailable
from .records import Lease, StoredResponse

if TYPE_CHECKING:
    from .store import PostgresStore


class Transaction:
    """One request's business transaction, committed together with its key record.

    Nothing is acquired until `connection()` is first awaited; a request whose handler never
    asks for it completes its key with a single autocommit statement instead.
    """

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self._conn: Any = None
        self._tx: Any = None
        self._ended = False
        self._lock = asyncio.Lock()

    @property
    def opened(self) -> bool:
        return self._conn is not None

    async def connection(self) -> Any:
        async with self._lock:
            if self._ended:
                raise RuntimeError(
                    "the request's transaction has ended: it commits with the response, so "
                    "code that runs after the response (a background task) cannot use it"
                )
            if self._conn is None:
                conn = await self._store.lend()
                try:
                    tx = conn.transaction()
                    await tx.start()
                except BaseException as exc:
                    await self._store.give_back(conn)
                    if isinstance(exc, UNAVAILABLE):
                        raise StoreUnavailable(f"cannot begin a transaction: {exc!r}") from exc
                    raise
                self._conn, self._tx = conn, tx
            return self._conn

    def failed(self, exc: BaseException | None = None) -> bool:
        """Whether the transaction's connection broke (so a 503, not the app's answer, is due)."""
        if isinstance(exc, StoreUnavailable):
            return True
        if self._conn is None:
            return False
        return is_closed(self._conn) or isinstance(exc, CONNECTION_LOST)

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Record the response and commit the business writes with it, atomically.

        Returns when the record expires once committed; None when the lease was lost and
        everything rolled back. Raises StoreUnavailable when the database failed; whatever was
        not committed is rolled back.
        """
        if self._conn is None:
            return await self._store.complete(lease, response, ttl_seconds=ttl_seconds)
        try:
            completed = await self._store.complete(
                lease, response, ttl_seconds=ttl_seconds, conn=self._conn
            )
            if completed is None:
                return None  # close() below rolls everything back
            tx, self._tx = self._tx, None
            try:
                await tx.commit()
            except UNAVAILABLE as exc:
                # If the connection broke after COMMIT reached the server, the transaction may
                # have committed after all; then the key row holds the response and the
                # client's retry is answered with its replay. Either way, both or neither.
                raise StoreUnavailable(f"commit failed: {exc!r}") from exc
            return completed
        finally:
            await self.close()

    async def close(self) -> None:
        """Roll back whatever is still open and return the connection to the pool."""
        self._ended = True
        conn, tx = self._conn, self._tx
        self._conn = self._tx = None
        if conn is None:
            return
        try:
            if tx is not None and not is_closed(conn):
                await tx.rollback()
        except UNAVAILABLE:
            pass  # a broken connection rolls back on the server by itself
        finally:
            await self._store.give_back(conn)
