"""Keeping the table small and unstuck: the reaper and the sweeper.

- The reaper deletes finished keys past their retention (and, optionally, the idempotent
  consumer's dedup records past theirs). It never touches an in-flight row or a row still
  inside its retention.
- The sweeper releases in-flight keys whose lease lapsed long ago: the owner died and nobody
  retried. A later retry would take such a key over anyway; sweeping makes the table say the
  truth and counts how often owners die. In transactional mode this is always safe (the dead
  owner's writes rolled back with its connection). In plain mode the dead owner may have
  committed its own writes before dying, and a retry after the sweep runs the handler again:
  the same risk a takeover carries, which is why plain mode is the weaker mode. It also
  deletes lease renewals long past (a completed request leaves its own behind).

Each has `run_once()` (one bounded batch, returns a count) and `run(stop)` (loops, sleeping
only after a batch that was not full). `BackgroundMaintenance` runs both inside an
application, with one runner among all its workers (a session advisory lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from ._errors import StoreError
from ._keystore import KeyStore
from ._reporting import key_hash

logger = logging.getLogger("idempotency_asgi.maintenance")

#: The advisory lock that elects the one background runner ("reap" in ASCII).
MAINTENANCE_LOCK_ID = 0x72656170

#: Batches of finished lease rows the sweeper deletes per run, at most.
_FORGET_ROUNDS = 10


class Reaper:
    """Deletes finished keys past their retention, in bounded batches (and, with
    `processed_retention_seconds`, the idempotent consumer's records older than that)."""

    def __init__(
        self,
        store: KeyStore,
        *,
        batch_size: int = 1000,
        idle_seconds: float = 30.0,
        pause_seconds: float = 0.05,
        processed_retention_seconds: float | None = None,
    ) -> None:
        self._store = store
        self.batch_size = batch_size
        self._idle = idle_seconds
        # Between two full batches: a backlog of millions of rows is worked off at up to
        # batch_size / pause rows a second without taking the database from live traffic.
        self._pause = pause_seconds
        self._processed_retention = processed_retention_seconds

    async def run_once(self) -> int:
        """One batch; returns how many rows it deleted."""
        deleted = await self._store.reap(batch_size=self.batch_size)
        if self._processed_retention is not None:
            deleted += await self._store.reap_processed(
                batch_size=self.batch_size, retention_seconds=self._processed_retention
            )
        if deleted:
            logger.info("reaper deleted=%d", deleted)
        return deleted

    async def run(self, stop: asyncio.Event) -> None:
        """Batches until `stop` is set: the next at once after a full one (after
        `pause_seconds`), after `idle_seconds` otherwise."""
        await _loop(self.run_once, self.batch_size, self._idle, stop, self._pause)


class Sweeper:
    """Releases in-flight keys whose lease lapsed more than `grace_seconds` ago (their owner
    died and nobody retried), logging each, and forgets lease renewals that long past."""

    def __init__(
        self,
        store: KeyStore,
        *,
        grace_seconds: float = 300.0,
        batch_size: int = 100,
        idle_seconds: float = 30.0,
    ) -> None:
        self._store = store
        self.grace_seconds = grace_seconds
        self.batch_size = batch_size
        self._idle = idle_seconds

    async def run_once(self) -> int:
        """One batch; returns how many keys it released."""
        swept = await self._store.sweep(
            batch_size=self.batch_size, grace_seconds=self.grace_seconds
        )
        for row in swept:
            logger.warning(
                "sweeper released tenant=%s key_hash=%s method=%s path=%s lapsed_seconds=%.0f",
                row["tenant_id"],
                key_hash(row["idempotency_key"]),
                row["method"],
                row["path"],
                row["lapsed_seconds"],
            )
        await self._forget_leases()
        return len(swept)

    async def _forget_leases(self) -> None:
        """Lease rows outlive their requests (a completion leaves its own behind): forget
        those long past, on the same grace. They come from every request slower than a
        third of its lease, so each call clears up to `_FORGET_ROUNDS` batches of them."""
        for _ in range(_FORGET_ROUNDS):
            forgotten = await self._store.forget_leases(
                batch_size=self.batch_size, grace_seconds=self.grace_seconds
            )
            if forgotten:
                logger.info("sweeper forgot lease rows=%d", forgotten)
            if forgotten < self.batch_size:
                return

    async def run(self, stop: asyncio.Event) -> None:
        """Batches until `stop` is set: the next at once after a full one, after
        `idle_seconds` otherwise."""
        await _loop(self.run_once, self.batch_size, self._idle, stop)


async def _loop(
    run_once: Callable[[], Awaitable[int]],
    batch_size: int,
    idle: float,
    stop: asyncio.Event,
    pause: float = 0.0,
) -> None:
    while not stop.is_set():
        try:
            full = await run_once() >= batch_size
        except StoreError as exc:
            logger.warning("maintenance batch failed: %s", exc)
            full = False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), pause if full else idle)


class BackgroundMaintenance:
    """Reaper and sweeper as one background task inside an application.

    Every worker process starts one; only the worker holding the advisory lock works, the
    others check again every `idle_seconds`, so a dead runner is replaced.
    """

    def __init__(self, reaper: Reaper, sweeper: Sweeper, *, idle_seconds: float = 30.0) -> None:
        self.reaper = reaper
        self.sweeper = sweeper
        self._idle = idle_seconds
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the background task (the middleware does, at startup)."""
        self._stop.clear()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop it and wait for the batch under way (the middleware does, at shutdown)."""
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def _run(self) -> None:
        store = self.reaper._store
        while not self._stop.is_set():
            try:
                async with store.exclusive(MAINTENANCE_LOCK_ID) as elected:
                    if elected:
                        await asyncio.gather(
                            self.reaper.run(self._stop), self.sweeper.run(self._stop)
                        )
            except StoreError as exc:
                logger.warning("background maintenance: %s", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._idle)
