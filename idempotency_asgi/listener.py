"""Waiting duplicates are woken by LISTEN/NOTIFY: one listening connection per store fans
the notifications out to the requests waiting on each key."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from . import sql
from .connections import UNAVAILABLE, is_closed

if TYPE_CHECKING:
    from .store import PostgresStore


class Listener:
    """One LISTENing connection per store, fanning notifications out to waiting requests."""

    def __init__(self, store: PostgresStore, conn: Any) -> None:
        self._store = store
        self._conn = conn
        self._futures: dict[str, set[asyncio.Future[None]]] = {}

    @classmethod
    async def start(cls, store: PostgresStore) -> Listener:
        conn = await store.lend()  # reset (UNLISTEN *) when given back
        listener = cls(store, conn)
        try:
            await conn.add_listener(sql.CHANNEL, listener._notified)
        except BaseException:
            await store.give_back(conn)
            raise
        return listener

    @property
    def closed(self) -> bool:
        return is_closed(self._conn)

    def subscribe(self, token: str) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.setdefault(token, set()).add(future)
        return future

    def unsubscribe(self, token: str, future: asyncio.Future[None]) -> None:
        waiting = self._futures.get(token)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._futures[token]
        future.cancel()

    def _notified(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for future in self._futures.pop(payload, ()):
            if not future.done():
                future.set_result(None)

    async def close(self) -> None:
        with contextlib.suppress(*UNAVAILABLE):
            await self._conn.remove_listener(sql.CHANNEL, self._notified)
        await self._store.give_back(self._conn)
