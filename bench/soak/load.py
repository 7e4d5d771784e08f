"""The load: `concurrency` drivers, each with up to three keep-alive connections of its own.

A driver takes the next due delayed copy if there is one, else the next key of the plan. A
single, delayed or fault key goes out on the driver's first connection; a concurrent key's two
or three copies are written on two or three connections one after the other without yielding to
the event loop, so they leave within microseconds of each other (the server is four processes:
they may land on one worker or on several). A delayed key's copy is scheduled 1 to `delay_max`
seconds after the first answer arrived, and goes ahead of new keys when due.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import hashlib
import random
import time
from dataclasses import dataclass, field

import orjson

from .audit import ALONGSIDE, FIRST, LATER, Answer
from .http import Connection, ProtocolError, Reply, post
from .plan import DELAYED, FAULT, Job


@dataclass
class Load:
    answers: list[Answer] = field(default_factory=list)
    #: seconds from a delayed key's first answer to its copy's write, the longest seen
    longest_delay: float = 0.0
    #: seconds between the first and the last write of a concurrent key's copies, the longest
    widest_concurrent_spread: float = 0.0
    connections_opened: int = 0
    began: float = 0.0
    #: when the last key of the plan went out (seconds since began): only delayed copies after
    exhausted_at: float = 0.0
    ended: float = 0.0


def request_bytes(job: Job, host: str) -> bytes:
    headers = [
        ("Authorization", f"Bearer {job.token}"),
        ("Idempotency-Key", job.key),
        ("Content-Type", "application/json"),
    ]
    if job.kind == FAULT:
        headers.append(("X-Fault-Status", "500"))
    return post(host, "/payments", headers, job.body)


def record(job: Job, copy: str, sent_at: float, outcome: Reply | BaseException) -> Answer:
    if isinstance(outcome, BaseException):
        return Answer(job.index, copy, sent_at, 0.0, error=f"{type(outcome).__name__}: {outcome}")
    answer = Answer(
        job.index,
        copy,
        sent_at,
        outcome.latency,
        status=outcome.status,
        replayed=outcome.headers.get(b"idempotent-replayed") == b"true",
        retry_after=outcome.headers.get(b"retry-after"),
        digest=hashlib.sha256(outcome.body).digest(),
    )
    if outcome.status == 201 and not answer.replayed:
        try:
            answer.payment_id = str(orjson.loads(outcome.body)["id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            answer.payment_id = "(unreadable body)"
    elif outcome.status >= 400 and b"json" in outcome.headers.get(b"content-type", b""):
        try:
            answer.problem = str(orjson.loads(outcome.body).get("type"))
        except (orjson.JSONDecodeError, AttributeError):
            answer.problem = "(unreadable body)"
    return answer


async def run(
    jobs: list[Job],
    host: str,
    port: int,
    *,
    concurrency: int,
    delay_min: float,
    delay_max: float,
    seed: int,
    load: Load,
) -> Load:
    """Send every job's requests, recording into `load` as they are answered (its `began`,
    a perf_counter reading, is the run's time zero)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed + 1)
    authority = f"{host}:{port}"
    plan = iter(jobs)
    due: collections.deque[tuple[Job, float]] = collections.deque()
    wake = asyncio.Event()
    pending_delayed = 0
    exhausted = False
    collected = 0

    def now() -> float:
        return time.perf_counter() - load.began

    def schedule(job: Job, answered_at: float) -> None:
        nonlocal pending_delayed
        pending_delayed += 1

        def push() -> None:
            due.append((job, answered_at))
            wake.set()

        loop.call_later(rng.uniform(delay_min, delay_max), push)

    async def send_one(conn: Connection, job: Job, copy: str) -> Answer:
        sent_at = now()
        try:
            await conn.ready()
            sent_at = now()
            reply: Reply | BaseException = await conn.send_now(request_bytes(job, authority))
        except (ProtocolError, OSError) as exc:
            reply = exc  # recorded as a request without an answer: the audit names it
        return record(job, copy, sent_at, reply)

    async def driver(conns: list[Connection]) -> None:
        nonlocal exhausted, pending_delayed, collected
        while True:
            if due:
                job, answered_at = due.popleft()
                pending_delayed -= 1
                load.longest_delay = max(load.longest_delay, now() - answered_at)
                load.answers.append(await send_one(conns[0], job, LATER))
                continue
            job_or_none = None if exhausted else next(plan, None)
            if job_or_none is None:
                if not exhausted:
                    exhausted = True
                    load.exhausted_at = now()
                if pending_delayed == 0:
                    wake.set()  # let the other drivers see the end too
                    return
                wake.clear()
                await wake.wait()
                continue
            job = job_or_none
            if len(load.answers) >= collected + 50_000:
                # A million answers kept for the audit would make every full collection walk
                # them all, each time longer: move them out of the collector's way.
                gc.freeze()
                collected = len(load.answers)
            if job.copies == 1:
                answer = await send_one(conns[0], job, FIRST)
                load.answers.append(answer)
                if job.kind == DELAYED:
                    schedule(job, now())
                continue
            # Concurrent copies: open the connections first, then write all of them at once.
            used = conns[: job.copies]
            started = now()
            try:
                for conn in used:
                    await conn.ready()
            except OSError as exc:
                for _ in used:
                    load.answers.append(record(job, ALONGSIDE, started, exc))
                continue
            request = request_bytes(job, authority)
            started = now()
            futures = [conn.send_now(request) for conn in used]
            spread = now() - started
            load.widest_concurrent_spread = max(load.widest_concurrent_spread, spread)
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            # The copies are identical: whichever the server claims first is the original.
            for outcome in outcomes:
                load.answers.append(record(job, ALONGSIDE, started, outcome))

    connections = [[Connection(host, port) for _ in range(3)] for _ in range(concurrency)]
    try:
        await asyncio.gather(*(driver(conns) for conns in connections))
    finally:
        load.ended = time.perf_counter()
        for conns in connections:
            for conn in conns:
                load.connections_opened += conn.opened
                conn.close()
    return load
