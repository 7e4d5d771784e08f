"""Duplicates that wait (`wait_seconds`) for the request in flight instead of taking a 409.

A waiter marks the key (`MARK_WAITING`), and the completion or release of a marked key
NOTIFYs; one listening connection of the store's own fans the notifications out to the
waiters of each key. A key an atomic-mode transaction runs has no row until it commits, so
nothing can be marked: its waiters look at the key's advisory lock instead, more and more
rarely, until it is free. Either way the waiter then claims again, and sees which it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .._errors import StoreError
from . import sql
from .connections import bounded, classify
from .database import Database, rows_in
from .keyhash import key_lock, request_lock, wake_token
from .listener import Listener
from .outages import SharedAttempt

logger = logging.getLogger("idempotency_asgi")

#: How often a waiter looks at an atomic transaction's lock: first after FIRST_LOOK seconds,
#: then twice as long each time, up to EVERY. A waiter so learns of a fast request's end
#: within about its own duration, and costs a slow one's database five statements a second.
FIRST_LOOK = 0.01
EVERY = 0.2


class Waiting:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._listener: Listener | None = None
        self._listening = SharedAttempt(
            self._listen, what="listening for completions", cooldown=db.cooldown
        )

    async def close(self) -> None:
        self._listening.cancel()
        self._listening = SharedAttempt(
            self._listen, what="listening for completions", cooldown=self._db.cooldown
        )
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.close()

    async def wait(
        self,
        *,
        tenant: str,
        key: str,
        timeout: float,
        locked: bool = False,
        fingerprint: bytes | None = None,
    ) -> None:
        """Return when the in-flight request holding this key completes or is released, or
        after `timeout` seconds, whichever is first; then claim again to see which.

        When no listener can be had within the time left (the database is slow, the pool is
        full), this simply sleeps out the time: the caller's next claim is its poll. It
        never raises for the store's sake, and never takes longer than `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if locked:
            # An atomic transaction holds the key: no row to mark, no wake-up to listen for
            # (and no connection kept for a listener, which a pool the application shares
            # with the store could not spare).
            await self._until_unlocked(tenant, key, fingerprint, deadline)
            return
        if not self._db.apart:
            # A store on the application's pool has no connection of its own to listen on,
            # and a listener would keep one of the application's for good: the caller's
            # next claim, after `timeout`, is its poll.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            return
        listener = await self._listener_within(timeout)
        if listener is None:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            return
        token = wake_token(tenant, key)
        woken = listener.subscribe(token)
        try:
            try:
                status = await self._db.call(
                    "execute", sql.MARK_WAITING, tenant, key, deadline=deadline
                )
            except StoreError:
                status = None  # unmarked: no wake-up will come, so this waits out its time
            if status is not None and rows_in(status) == 0:
                # No row in flight to mark: it finished, or is finishing (its row held by a
                # completion under way), or an atomic transaction holds it.
                await self._until_unlocked(tenant, key, fingerprint, deadline)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await bounded(asyncio.shield(woken), max(0.0, deadline - loop.time()))
        finally:
            listener.unsubscribe(token, woken)

    async def _until_unlocked(
        self, tenant: str, key: str, fingerprint: bytes | None, deadline: float
    ) -> None:
        """Return once the key's advisory lock is free, or at `deadline`; after a first pause
        at least, so that a waiter whose request is finishing (its completion's COMMIT under
        way) looks again at that pace, not at once and again."""
        locks = (
            key_lock(tenant, key),
            None if fingerprint is None else request_lock(tenant, key, fingerprint),
        )
        loop = asyncio.get_running_loop()
        pause = FIRST_LOOK
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        while True:
            try:
                if await self._db.call(
                    "fetchval", sql.LOCK_FREE, tenant, key, *locks, deadline=deadline
                ):
                    return
            except StoreError:
                pass  # the next look, or the deadline
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, EVERY)

    async def _listener_within(self, timeout: float) -> Listener | None:
        """The store's one listener, started by whichever waiter comes first and shared by
        those that come meanwhile; None when it cannot be had within `timeout`."""
        listener = self._listener
        if listener is not None and not listener.closed:
            return listener
        try:
            return await self._listening(min(timeout, self._db.timeout))
        except StoreError as exc:
            logger.info("waiting by polling, no listener: %s", exc)
            return None

    async def _listen(self) -> Listener:
        dead, self._listener = self._listener, None
        if dead is not None:
            await dead.close()  # its connection died: give its place back
        conn, give_back = await bounded(self._db.own_connection(), self._db.timeout)
        try:
            listener = await bounded(Listener.start(conn, give_back), self._db.timeout)
        except BaseException as exc:
            await give_back(conn)
            raise classify("cannot listen for completions", exc) from exc
        self._listener = listener
        return listener
