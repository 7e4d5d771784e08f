"""Waiting duplicates are woken by LISTEN/NOTIFY: one listening connection per store fans
the notifications out to the requests waiting on each key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from . import sql
from .connections import DATABASE_ERRORS, bounded, is_closed

#: How long closing waits for the server to confirm the UNLISTEN.
CLOSE_SECONDS = 1.0


class Listener:
    """One LISTENing connection per store, fanning notifications out to waiting requests."""

    def __init__(self, conn: Any, give_back: Callable[[Any], Awaitable[None]]) -> None:
        self._conn = conn
        self._give_back = give_back
        self._futures: dict[str, set[asyncio.Future[None]]] = {}

    @classmethod
    async def start(cls, conn: Any, give_back: Callable[[Any], Awaitable[None]]) -> Listener:
        """LISTEN on `conn`; `give_back(conn)` is how `close()` returns it (UNLISTEN comes
        with the reset or the close that implies)."""
        listener = cls(conn, give_back)
        await conn.add_listener(sql.CHANNEL, listener._notified)
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
        # Bounded: a database that stopped answering must not hold the store's close.
        with contextlib.suppress(asyncio.TimeoutError, *DATABASE_ERRORS):
            await bounded(self._conn.remove_listener(sql.CHANNEL, self._notified), CLOSE_SECONDS)
        await self._give_back(self._conn)
