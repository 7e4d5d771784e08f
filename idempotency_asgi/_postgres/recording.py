"""Ending and extending a claim: the completion (the answer recorded), the release (the key
freed for the next retry), the renewal (a heartbeat's), each fenced by the lease's token, and
each batched under load (see batching.py).

None of them is new work: the breaker never refuses them while the database answers (see
database.py). A batched completion or release reaches its rows by their ctid; a row that
another transaction updated while the statement ran is not reached that way, and its own
one-row statement then finds it by its key: a row a batch missed is never taken for a lost
lease on the batch's word alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from typing import Any

from .._errors import StoreRefused, StoreUnavailable
from .._records import FORMAT_VERSION, Lease, StoredResponse, encode_headers
from . import sql
from .batching import Batcher
from .database import UNREACHED, Database, rows_in
from .outages import COOLDOWN_SECONDS

logger = logging.getLogger("idempotency_asgi")

#: Rows one batched statement carries at most: releases and renewals are small; a completion
#: carries its response (up to max_stored_response_bytes), so fewer of those.
MAX_BATCH_ROWS = 64
MAX_BATCH_RESPONSES = 16


class Records:
    def __init__(self, db: Database, *, batch: bool, lanes: int) -> None:
        self._db = db
        self._releasing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.completions: Batcher[tuple[Any, ...], Any] | None = None
        self.releases: Batcher[Lease, Any] | None = None
        self.renewals: Batcher[Lease, Any] | None = None
        if batch:
            self.completions = Batcher(
                self._complete_rows, key=_args_key, lanes=lanes, max_size=MAX_BATCH_RESPONSES
            )
            self.releases = Batcher(
                self._release_rows, key=_lease_key, lanes=lanes, max_size=MAX_BATCH_ROWS
            )
            self.renewals = Batcher(
                self._renew_rows, key=_lease_key, lanes=lanes, max_size=MAX_BATCH_ROWS
            )

    async def close(self) -> None:
        self._closed = True
        for batcher in (self.completions, self.releases, self.renewals):
            if batcher is not None:
                await batcher.close()
        tasks = list(self._releasing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def open(self) -> None:
        self._closed = False

    # -- the protocol ----------------------------------------------------------------------

    async def complete(
        self,
        lease: Lease,
        response: StoredResponse,
        *,
        ttl_seconds: float,
        conn: Any = None,
        timeout: float | None = None,
    ) -> datetime | None:
        """Store the response, if this lease still holds the key; return when the record
        expires, or None when the lease no longer holds the key.

        With `conn`, the write happens on that connection (inside its open transaction), and
        its errors are asyncpg's own."""
        args = (
            lease.tenant,
            lease.key,
            lease.token,
            FORMAT_VERSION,
            response.status,
            encode_headers(response.headers),
            response.body,
            ttl_seconds,
        )
        if conn is None:
            expires_at: datetime | None
            if self.completions is not None and not self._db.distributed:
                expires_at = await self.completions.submit(args, deadline=self._deadline())
            else:
                expires_at = await self._db.call("fetchval", sql.COMPLETE, *args)
            return expires_at
        # Inside the caller's transaction: a failure here may be the caller's (an aborted
        # transaction), so it is raised as it is, for the caller to tell which. The row is
        # found by its ctid where the claim told it (see sql.COMPLETE_BY_ROW), by its key if
        # it moved since.
        timeout = self._db.timeout if timeout is None else timeout
        if lease.row is not None and not self._db.distributed:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            found: datetime | None = await conn.fetchval(
                self._db.qualified(sql.COMPLETE_BY_ROW), *args, lease.row, timeout=timeout
            )
            if found is not None:
                return found
            timeout = max(deadline - loop.time(), 0.001)
        return await conn.fetchval(  # type: ignore[no-any-return]
            self._db.qualified(sql.COMPLETE), *args, timeout=timeout
        )

    async def release(self, lease: Lease) -> None:
        """Give the key up so that the next retry runs afresh (after a 5xx, an error...).
        Cancelled while its statement runs, it is freed in the background: a statement cut
        short may have freed nothing, and the key would otherwise stay in flight for its
        lease (a release that lands twice frees it once: its token fences it)."""
        if self.releases is not None and not self._db.distributed:
            again = partial(self.release_soon, lease)
            await self.releases.submit(lease, deadline=self._deadline(), cut=again)
            return
        try:
            await self._db.call("execute", sql.RELEASE, lease.tenant, lease.key, lease.token)
        except asyncio.CancelledError:
            self.release_soon(lease)
            raise

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost (taken over or released)."""
        if self.renewals is not None and not self._db.distributed:
            renewed: bool = await self.renewals.submit(lease, deadline=self._deadline())
            return renewed
        status = await self._db.call(
            "execute", sql.RENEW, lease.tenant, lease.key, lease.token, lease.seconds
        )
        return rows_in(status) > 0

    async def holds(self, lease: Lease) -> bool:
        """Whether the lease still holds its key (in flight under its token)."""
        held: bool = await self._db.call(
            "fetchval", sql.HOLDS, lease.tenant, lease.key, lease.token
        )
        return held

    def release_soon(self, lease: Lease, *, after: float = 0.0) -> None:
        """Free the key in the background: for an owner whose release failed because the
        database was away (a failover, a restart), or a claim that got no answer and may
        have landed. It tries again until the lease would have lapsed anyway; a retry of the
        key then runs as soon as the database is back, not a whole lease later."""
        if self._closed:
            return  # nothing runs on behind a closed store: the key lapses on its own
        task = asyncio.ensure_future(self._release_until_lapsed(lease, after=after))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def release_until_lapsed(self, lease: Lease) -> None:
        """What `release_soon` runs: for a late COMMIT that failed (see lending.py)."""
        await self._release_until_lapsed(lease)

    async def _release_until_lapsed(self, lease: Lease, *, after: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + lease.seconds
        await asyncio.sleep(after)
        pause = 0.1
        while True:
            try:
                await self.release(lease)
                return
            except StoreRefused as exc:
                logger.error("could not free the key; it is free when its lease lapses: %s", exc)
                return
            except StoreUnavailable as exc:
                if loop.time() + pause >= give_up_at:
                    logger.warning("could not free the key before its lease lapsed: %s", exc)
                    return
            await asyncio.sleep(pause)
            pause = min(pause * 2, COOLDOWN_SECONDS)  # a probe's pace once it is back

    # -- batched statements ----------------------------------------------------------------

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._db.timeout

    async def _complete_rows(
        self, batch: Sequence[tuple[Any, ...]], timeout: float, wanted: Callable[[int], bool]
    ) -> list[Any]:
        # COMPLETE's arguments: tenant, key, token, format, status, headers, body, ttl.
        rows = [(a[0], a[1], a[2], a[4], a[5], a[6], a[7]) for a in batch]
        results = await self._db.batched(
            batch,
            timeout,
            wanted,
            one=(sql.COMPLETE, "fetchval"),
            many=sql.COMPLETE_MANY,
            columns=rows,
            extra=(FORMAT_VERSION,),
            result=lambda row: row["expires_at"],
        )
        return await self._by_key(batch, results, timeout, wanted, (sql.COMPLETE, "fetchval"))

    async def _release_rows(
        self, batch: Sequence[Lease], timeout: float, wanted: Callable[[int], bool]
    ) -> list[Any]:
        args = [(lease.tenant, lease.key, lease.token) for lease in batch]
        results = await self._db.batched(
            args,
            timeout,
            wanted,
            one=(sql.RELEASE, "execute"),
            many=sql.RELEASE_MANY,
            columns=args,
            extra=(),
            result=lambda row: None,
        )
        return await self._by_key(args, results, timeout, wanted, (sql.RELEASE, "execute"))

    async def _renew_rows(
        self, batch: Sequence[Lease], timeout: float, wanted: Callable[[int], bool]
    ) -> list[Any]:
        args = [(lease.tenant, lease.key, lease.token, lease.seconds) for lease in batch]
        results = await self._db.batched(
            args,
            timeout,
            wanted,
            one=(sql.RENEW, "execute"),
            many=sql.RENEW_MANY,
            columns=args,
            extra=(),
            result=lambda row: True,
        )
        # RENEW alone answers with its status ("INSERT 0 1"): renewed when it wrote a row. A
        # renewal reaches its row by its key already: a row it did not reach is not held.
        return [
            rows_in(r) > 0 if isinstance(r, str) else (False if r is UNREACHED else r)
            for r in results
        ]

    async def _by_key(
        self,
        args: Sequence[tuple[Any, ...]],
        results: list[Any],
        timeout: float,
        wanted: Callable[[int], bool],
        one: tuple[str, str],
    ) -> list[Any]:
        """The batch's results, with each row it did not reach tried again alone, by its key
        (the one-row statement's answer is the row's)."""
        missed = [i for i, result in enumerate(results) if result is UNREACHED]
        if not missed:
            return results
        deadline = asyncio.get_running_loop().time() + timeout
        query, method = one
        again = await asyncio.gather(
            *(
                self._db.alone(method, query, args[i], deadline) if wanted(i) else _nobody_waits()
                for i in missed
            )
        )
        for i, result in zip(missed, again, strict=True):
            results[i] = result
        return results


async def _nobody_waits() -> StoreUnavailable:
    return StoreUnavailable("nobody waits for this row any more")


def _args_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return args[0], args[1]  # tenant, key


def _lease_key(lease: Lease) -> tuple[str, str]:
    return lease.tenant, lease.key
