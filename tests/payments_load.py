"""Load on the example payments API, and the audit of what it was told.

`PaymentsLoad` runs N clients against the API over HTTP. Each creates payments one after the
other, each with a fresh Idempotency-Key, and retries that key until it gets a 2xx, as a
well-behaved payments client would; every attempt is recorded (key, status, latency, or no
answer within the client's timeout). `audit` then checks the database against what the
clients were told: a payment acknowledged (2xx, replayed or not) is there exactly once, and no
key ever made two payments.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.server import UvicornProcess, child_pids, dies_with_parent

PAYMENT = {"amount": 1250, "currency": "EUR", "customer_id": "cus_ha"}

#: Answers no retry of the same request can change: the client gives the key up. (409 is
#: "in flight, retry later"; a 5xx or no answer is retried too.)
_FINAL_REFUSALS = frozenset(range(400, 500)) - {409}


class PaymentsApp(UvicornProcess):
    """`uvicorn examples.payments.app:app --workers N` on DATABASE_URL `dsn`, serving one
    tenant (`tenant`) for bearer token `token`. No worker outlives `stop()`."""

    def __init__(
        self,
        dsn: str,
        *,
        workers: int = 2,
        tenant: str = "acme",
        token: str = "sk_test_ha",
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        super().__init__(
            "examples.payments.app:app",
            {"DATABASE_URL": dsn, "PAYMENTS_TOKENS": f"{token}={tenant}", **(env or {})},
            # A worker whose requests are stuck in the database would otherwise hold up its
            # shutdown (and the test's) for as long as they are.
            extra_args=("--workers", str(workers), "--timeout-graceful-shutdown", "3"),
            log=log,
        )
        self.tenant = tenant
        self.token = token
        self.workers = workers
        # SIGTERM, uvicorn's own shutdown signal: it stops its workers before it goes.
        self.preexec = dies_with_parent(signal.SIGTERM)

    def start(self, ready_path: str = "/healthz", timeout: float = 30.0) -> PaymentsApp:
        # A run interrupted where no `finally` runs (SIGTERM inside the event loop) still
        # exits the interpreter: stop the server then at the latest.
        atexit.register(self.stop)
        super().start(ready_path, timeout)
        return self

    def stop(self) -> None:
        atexit.unregister(self.stop)
        workers = [] if self.process is None else child_pids(self.process.pid)
        super().stop()
        for pid in workers:  # the supervisor was killed before it could stop them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class Attempt:
    """One request. Times are time.monotonic() seconds, the clock the tests use too."""

    client: int
    key: str
    started: float
    latency: float
    #: None: no answer within the client's timeout, or the connection failed (see `error`)
    status: int | None
    error: str | None = None
    payment_id: str | None = None
    replayed: bool = False

    @property
    def answered(self) -> bool:
        return self.status is not None

    @property
    def ended(self) -> float:
        return self.started + self.latency


@dataclass
class PaymentsLoad:
    """`clients` concurrent clients creating payments until `stop()`; see the module doc."""

    base_url: str
    token: str = "sk_test_ha"
    clients: int = 16
    #: the longest a client waits for one answer before it gives up on it (and retries)
    request_timeout: float = 10.0
    #: the pause before a retry (after anything but a 2xx)
    retry_pause: float = 0.1
    attempts: list[Attempt] = field(default_factory=list)
    #: key -> the attempt that got its 2xx (the client moves on to a new key after it)
    acknowledged: dict[str, Attempt] = field(default_factory=dict)
    #: key -> when the first attempt at it started
    first_tried: dict[str, float] = field(default_factory=dict)
    #: keys a client gave up on: it was told something no retry changes (a 4xx but 409)
    refused: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> PaymentsLoad:
        self._stopping.clear()
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(self.clients)]
        return self

    async def stop(self, drain: float) -> list[str]:
        """Start no new key; give each client up to `drain` seconds to get its current key
        acknowledged; return the keys still unacknowledged after that (they are abandoned)."""
        self._stopping.set()
        done, pending = await asyncio.wait(self._tasks, timeout=drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # a bug in the driver itself should not pass unnoticed
        return sorted(set(self.first_tried) - set(self.acknowledged) - set(self.refused))

    async def _client(self, number: int) -> None:
        headers = {"authorization": f"Bearer {self.token}"}
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits) as http:
            while not self._stopping.is_set():
                key = str(uuid.uuid4())
                self.first_tried[key] = time.monotonic()
                while True:
                    attempt = await self._attempt(http, number, key, headers)
                    self.attempts.append(attempt)
                    if attempt.status is not None and 200 <= attempt.status < 300:
                        self.acknowledged[key] = attempt
                        break
                    if attempt.status in _FINAL_REFUSALS:
                        self.refused[key] = attempt.status
                        break
                    await asyncio.sleep(self.retry_pause)

    async def _attempt(
        self, http: httpx.AsyncClient, number: int, key: str, headers: dict[str, str]
    ) -> Attempt:
        started = time.monotonic()
        try:
            # The whole exchange, not each read: httpx's own timeouts are per operation.
            response = await asyncio.wait_for(
                http.post(
                    "/payments",
                    json={**PAYMENT, "customer_id": f"cus_ha_{number}"},
                    headers={**headers, "idempotency-key": key},
                    timeout=None,
                ),
                self.request_timeout,
            )
        except asyncio.TimeoutError:
            return Attempt(number, key, started, time.monotonic() - started, None, "timeout")
        except httpx.TransportError as exc:
            error = type(exc).__name__
            return Attempt(number, key, started, time.monotonic() - started, None, error)
        latency = time.monotonic() - started
        payment_id = None
        if 200 <= response.status_code < 300:
            payment_id = response.json()["id"]
        return Attempt(
            number,
            key,
            started,
            latency,
            response.status_code,
            payment_id=payment_id,
            replayed=response.headers.get("idempotent-replayed") == "true",
        )

    # -- summaries -----------------------------------------------------------------------

    def statuses(self, since: float = 0.0, until: float = float("inf")) -> Counter[str]:
        """How many attempts that started in [since, until) got each answer ("none" for no
        answer within the timeout, the error's name for a broken connection)."""
        return Counter(
            str(a.status) if a.status is not None else (a.error or "none")
            for a in self.attempts
            if since <= a.started < until
        )

    def unanswered(self) -> list[Attempt]:
        return [a for a in self.attempts if a.status is None]

    def slower_than(self, seconds: float) -> list[Attempt]:
        """Attempts whose answer took longer than `seconds`, or never came."""
        return [a for a in self.attempts if a.status is None or a.latency > seconds]

    def first_success_after(self, moment: float) -> float | None:
        """Seconds from `moment` to the first 2xx answered after it."""
        ends = [ack.ended for ack in self.acknowledged.values() if ack.ended >= moment]
        return None if not ends else min(ends) - moment

    def in_flight_at(self, moment: float) -> list[str]:
        """Keys with an attempt under way at `moment`, or tried before it and not yet
        acknowledged by then."""
        keys = set()
        for a in self.attempts:
            if a.started <= moment < a.ended:
                keys.add(a.key)
        for key, first in self.first_tried.items():
            acked = self.acknowledged.get(key)
            if first <= moment and (acked is None or acked.ended > moment):
                keys.add(key)
        return sorted(keys)

    def tries(self, key: str) -> list[Attempt]:
        return [a for a in self.attempts if a.key == key]


@dataclass(frozen=True)
class Audit:
    acknowledged: int
    #: acknowledged keys whose payment (the id the client was given) is not in the database
    lost: list[str]
    #: keys with more than one payment
    duplicated: list[str]
    #: payments in the database for keys never acknowledged (made, but the answer was lost)
    unacknowledged_made: int
    payments: int


async def audit(conn: Any, tenant: str, load: PaymentsLoad) -> Audit:
    """Compare the payments on `conn`'s server with what `load`'s clients were told."""
    rows = await conn.fetch(
        "SELECT idempotency_key, array_agg(id) AS ids FROM payments"
        " WHERE tenant_id = $1 GROUP BY idempotency_key",
        tenant,
    )
    made: dict[str, list[str]] = {row["idempotency_key"]: list(row["ids"]) for row in rows}
    lost = sorted(
        key for key, ack in load.acknowledged.items() if ack.payment_id not in made.get(key, [])
    )
    duplicated = sorted(key for key, ids in made.items() if len(ids) > 1)
    return Audit(
        acknowledged=len(load.acknowledged),
        lost=lost,
        duplicated=duplicated,
        unacknowledged_made=sum(1 for key in made if key not in load.acknowledged),
        payments=sum(len(ids) for ids in made.values()),
    )
