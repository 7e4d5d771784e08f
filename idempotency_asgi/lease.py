"""Keeping a lease alive while the application runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .errors import StoreError
from .records import Lease
from .store import PostgresStore

logger = logging.getLogger("idempotency_asgi")

#: Renewals per lease period. Three gives a live request two chances to renew (a slow store,
#: a busy event loop) before its lease can lapse and another attempt could take it over.
RENEWALS_PER_LEASE = 3


class Heartbeat:
    def __init__(self, store: PostgresStore, lease: Lease) -> None:
        self._store = store
        self._lease = lease
        self._task: asyncio.Task[None] | None = None
        self.lost = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _beat(self) -> None:
        interval = self._lease.seconds / RENEWALS_PER_LEASE
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self._store.renew(self._lease):
                    # Taken over: the fenced completion will fail and say so; nothing to do here.
                    self.lost = True
                    return
            except StoreError as exc:
                # Keep trying: the lease may still be renewed before it lapses.
                logger.warning("lease renewal failed for tenant %s: %s", self._lease.tenant, exc)
