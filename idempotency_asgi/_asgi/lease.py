"""Holding a key by a lease: renewed while the application runs (the heartbeat), and how a
run in plain or transactional mode ends with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime

from .._errors import StoreError, StoreUnavailable
from .._keystore import KeyStore
from .._records import HeldReason, Lease, StoredResponse

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


class LeaseHold:
    """How a run in plain or transactional mode holds its key: a lease, renewed while the
    application runs, and the request's transaction, opened if the handler asks for it."""

    atomic = False
    short = False

    def __init__(
        self,
        store: KeyStore,
        lease: Lease,
        *,
        isolation: str | None = None,
        idle_seconds: float = 0.0,
    ) -> None:
        self._store = store
        self.lease = lease
        self.seconds = lease.seconds
        self.transaction = store.transaction(isolation, idle_seconds)
        self._heartbeat = Heartbeat(store, lease)

    def start(self) -> None:
        self._heartbeat.start()

    async def stop(self) -> None:
        await self._heartbeat.stop()

    async def complete(self, response: StoredResponse, *, ttl_seconds: float) -> datetime | None:
        return await self.transaction.complete(self.lease, response, ttl_seconds=ttl_seconds)

    async def record_apart(
        self, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        return await self._store.complete(self.lease, response, ttl_seconds=ttl_seconds)

    async def release(self) -> None:
        try:
            await self._store.release(self.lease)
        except StoreUnavailable as exc:
            # The database is away (a failover, say): keep trying in the background, so the
            # retry after it is back runs at once rather than a whole lease later.
            logger.warning("could not release the key yet, trying again: %s", exc)
            self._store.release_soon(self.lease)
        except StoreError as exc:
            logger.error("could not release the key; it is free when its lease lapses: %s", exc)

    async def keep(self, reason: HeldReason) -> None:
        # Nothing renews it any more: it lapses on its own. Its row says why it is held, and
        # until when, so that an operator can tell it from a request that runs. Rolled back
        # first: the hold never waits for a pooled connection while holding one (the lease,
        # not the transaction, keeps the key).
        await self.transaction.close()
        try:
            if not await self._store.hold(self.lease, reason):
                logger.warning("the key to hold (%s) is not this request's any more", reason.value)
        except StoreError as exc:
            logger.error(
                "could not mark the key held (%s); it is held all the same until its lease"
                " lapses, listed by `idempotency-asgi held` as lease-lapsed: %s",
                reason.value,
                exc,
            )

    async def lost(self) -> bool:
        """Whether the key was taken over (asked after a conflict that may say so: under
        REPEATABLE READ, a completion whose row was taken over fails to serialize)."""
        try:
            return not await self._store.holds(self.lease)
        except StoreError:
            return False
