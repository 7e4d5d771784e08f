"""The outbox worker: delivers payment events to the provider, at least once.

`POST /payments` writes its outbox event in the same transaction as the payment, so an event
exists exactly when its payment does. This worker claims a batch of due events with
`FOR UPDATE SKIP LOCKED` (several workers share the work without blocking each other), delivers
each with the payment's idempotency key forwarded as `Idempotency-Key: <tenant>:<key>`, and marks
it delivered in the same transaction. A worker killed mid-batch rolls its marks back and the
events are delivered again: the provider dedupes on the forwarded key.

A failed delivery is retried with exponential backoff (with jitter); after `max_attempts`, or at
once on a permanent refusal (a 4xx other than 408/409/425/429), the event is moved to the
`dead` state for a person to look at.

Run: `python -m examples.payments.worker` with DATABASE_URL and PAYMENTS_DOWNSTREAM_URL
(default http://127.0.0.1:8001/charges).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from .settings import asyncpg_dsn

logger = logging.getLogger("examples.payments.worker")

_CLAIM = """
SELECT id, tenant_id, payment_id, event_type, idempotency_key, payload, attempts
FROM outbox
WHERE state = 'pending' AND next_attempt_at <= now()
ORDER BY next_attempt_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED
"""

_DELIVERED = """
UPDATE outbox SET state = 'delivered', attempts = attempts + 1, delivered_at = now(),
    last_error = NULL
WHERE id = $1
"""

_RETRY = """
UPDATE outbox SET attempts = attempts + 1, last_error = $2,
    next_attempt_at = now() + make_interval(secs => $3)
WHERE id = $1
"""

_DEAD = """
UPDATE outbox SET state = 'dead', attempts = attempts + 1, last_error = $2 WHERE id = $1
"""

_RETRYABLE_4XX = frozenset({408, 409, 425, 429})


class PermanentFailure(Exception):
    """The downstream refused the event for good: retrying cannot help."""


class RetryableFailure(Exception):
    """The downstream failed this time (5xx, 408/409/425/429): try again later."""


@dataclass(frozen=True)
class Batch:
    delivered: int = 0
    retried: int = 0
    dead: int = 0

    @property
    def claimed(self) -> int:
        return self.delivered + self.retried + self.dead


class OutboxWorker:
    def __init__(
        self,
        pool: asyncpg.Pool,
        client: httpx.AsyncClient,
        *,
        downstream_url: str,
        batch_size: int = 10,
        max_attempts: int = 8,
        base_backoff: float = 0.5,
        max_backoff: float = 300.0,
        idle_sleep: float = 0.5,
    ) -> None:
        self._pool = pool
        self._client = client
        self._url = downstream_url
        self._batch_size = batch_size
        self._max_attempts = max_attempts
        self._base_backoff = base_backoff
        self._max_backoff = max_backoff
        self._idle_sleep = idle_sleep

    def backoff(self, attempts: int) -> float:
        """Seconds before attempt `attempts + 1`: doubling from `base_backoff`, capped, with
        jitter so that events that failed together do not all come back together."""
        ceiling = min(self._max_backoff, self._base_backoff * 2 ** (attempts - 1))
        return random.uniform(ceiling / 2, ceiling)

    async def run_once(self) -> Batch:
        """Claim and deliver one batch; return what happened to it."""
        delivered = retried = dead = 0
        async with self._pool.acquire() as conn, conn.transaction():
            for event in await conn.fetch(_CLAIM, self._batch_size):
                attempts = event["attempts"] + 1
                try:
                    await self._deliver(event)
                except PermanentFailure as exc:
                    await conn.execute(_DEAD, event["id"], str(exc))
                    dead += 1
                    logger.error("event %s dead: %s", event["id"], exc)
                except (httpx.HTTPError, RetryableFailure) as exc:
                    if attempts >= self._max_attempts:
                        await conn.execute(_DEAD, event["id"], f"{exc} (attempt {attempts})")
                        dead += 1
                        logger.error("event %s dead after %d attempts", event["id"], attempts)
                    else:
                        await conn.execute(_RETRY, event["id"], str(exc), self.backoff(attempts))
                        retried += 1
                else:
                    await conn.execute(_DELIVERED, event["id"])
                    delivered += 1
        return Batch(delivered, retried, dead)

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until `stop` is set, sleeping only after a batch that was not full."""
        while not stop.is_set():
            batch = await self.run_once()
            if batch.claimed < self._batch_size:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._idle_sleep)

    async def _deliver(self, event: Any) -> None:
        headers = {
            "idempotency-key": f"{event['tenant_id']}:{event['idempotency_key']}",
            "content-type": "application/json",
            "x-event-id": str(event["id"]),
            "x-event-type": event["event_type"],
        }
        response = await self._client.post(self._url, content=event["payload"], headers=headers)
        status = response.status_code
        if 200 <= status < 300:
            return
        if 400 <= status < 500 and status not in _RETRYABLE_4XX:
            raise PermanentFailure(f"downstream refused with {status}: {response.text[:200]}")
        raise RetryableFailure(f"downstream answered {status}")


@contextlib.asynccontextmanager
async def running(pool: asyncpg.Pool, downstream_url: str) -> AsyncIterator[None]:
    """The worker as a background task (the API runs one with PAYMENTS_OUTBOX_WORKER=1)."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=10.0) as client:
        worker = OutboxWorker(pool, client, downstream_url=downstream_url)
        task = asyncio.create_task(worker.run(stop))
        try:
            yield
        finally:
            stop.set()
            await task


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    dsn = asyncpg_dsn(os.environ["DATABASE_URL"])
    url = os.environ.get("PAYMENTS_DOWNSTREAM_URL", "http://127.0.0.1:8001/charges")
    max_attempts = int(os.environ.get("OUTBOX_MAX_ATTEMPTS", "8"))
    base_backoff = float(os.environ.get("OUTBOX_BASE_BACKOFF_SECONDS", "0.5"))
    batch_size = int(os.environ.get("OUTBOX_BATCH_SIZE", "10"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            worker = OutboxWorker(
                pool,
                client,
                downstream_url=url,
                batch_size=batch_size,
                max_attempts=max_attempts,
                base_backoff=base_backoff,
            )
            logger.info("delivering outbox events to %s", url)
            await worker.run(stop)
    finally:
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
