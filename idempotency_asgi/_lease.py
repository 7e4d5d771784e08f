"""Keeping a lease alive while the application runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ._errors import StoreError
from ._keystore import KeyStore
from ._records import Lease

logger = logging.getLogger("idempotency_asgi")

#: Renewals per lease period. Three gives a live request two chances to renew (a slow store,
#: a busy event loop) before its lease can lapse and another attempt could take it over.
RENEWALS_PER_LEASE = 3


class Heartbeat:
    """Renews a lease every `seconds / RENEWALS_PER_LEASE` while the request runs.

    Most requests end long before the first renewal is due, so nothing is started for them
    but a timer; a renewal task exists only while a slow request is actually being renewed.
    """

    def __init__(self, store: KeyStore, lease: Lease) -> None:
        self._store = store
        self._lease = lease
        self._interval = lease.seconds / RENEWALS_PER_LEASE
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._due)

    async def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _due(self) -> None:
        self._timer = None
        if not self._stopped:
            self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        try:
            if not await self._store.renew(self._lease):
                # Taken over: stop renewing; the fenced completion will fail and say so.
                return
        except StoreError as exc:
            # Keep trying: the lease may still be renewed before it lapses.
            logger.warning("lease renewal failed for tenant %s: %s", self._lease.tenant, exc)
        if not self._stopped:
            self._timer = asyncio.get_running_loop().call_later(self._interval, self._due)
