"""A worker goes away (`kill -9` of its postmaster and every process of it) while the app
serves: the tenants whose shard it holds get 503 with Retry-After, within the store's
timeout, and their handlers never run; every other tenant's requests go on unharmed; when the
worker is back, nothing recorded before was lost, and nothing runs twice. A cluster of this
module's own (the session's other tests keep theirs whole). What each phase took is printed
(`-s`); bench/citus.py measures the same on a quiet machine."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from tests import server
from tests.citus_cluster import (
    distributed,
    running_cluster,
    skip_unless_available,
    tenants_on,
)
from tests.helpers import effects, headers, new_key
from tests.server import UvicornProcess

pytestmark = [pytest.mark.citus, pytest.mark.slow]

#: The store's timeout in these tests (seconds): what a request may wait on the database.
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[Any]:
    skip_unless_available()
    with running_cluster() as cluster:
        yield distributed(cluster)


@pytest.fixture(scope="module")
async def odb(own_cluster: Any) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(own_cluster.coordinator, min_size=1, max_size=4)
    yield pool
    await pool.close()


def serve(cluster: Any, mode: str) -> UvicornProcess:
    return server.serve(
        cluster.coordinator,
        store={"timeout": TIMEOUT},
        options={"atomic": mode == "atomic"},
        IDEMPOTENCY_LEASE_SECONDS="2",
    )


async def timed(http: httpx.AsyncClient, tenant: str, key: str, **extra: str) -> Any:
    started = time.monotonic()
    answer = await http.post("/tx/charge", json={}, headers=headers(tenant, key, **extra))
    return answer, time.monotonic() - started


@pytest.mark.parametrize("mode", ["two_phase", "atomic"])
async def test_a_worker_killed_and_back(own_cluster, odb, mode):
    cluster = own_cluster
    down_port = cluster.port + 1
    gone = await tenants_on(odb, down_port, 3, f"down-{mode}")
    kept = await tenants_on(odb, cluster.port + 2, 3, f"kept-{mode}")
    recorded = {tenant: new_key() for tenant in gone + kept}
    process = serve(cluster, mode)
    try:
        async with httpx.AsyncClient(base_url=process.url, timeout=30) as http:
            before = [await timed(http, t, k) for t, k in recorded.items()]
            assert [a.status_code for a, _ in before] == [201] * len(recorded)
            # one request of a tenant on the doomed worker is mid-handler when it dies
            caught = asyncio.create_task(timed(http, gone[0], "caught", x_delay_ms="1500"))
            await asyncio.sleep(0.5)
            cluster.kill(1)
            killed_at = time.monotonic()
            during_gone = await asyncio.gather(
                *(timed(http, t, f"during-{n}") for n, t in enumerate(gone)),
                *(timed(http, t, recorded[t]) for t in gone),  # replays of what it holds
            )
            during_kept = await asyncio.gather(
                *(timed(http, t, f"during-{n}") for n, t in enumerate(kept)),
                *(timed(http, t, recorded[t]) for t in kept),
            )
            caught_answer, _ = await caught
            cluster.start_node(1)
            back_at = time.monotonic()
            first_success = None
            while first_success is None:
                answer, _ = await timed(http, gone[0], recorded[gone[0]])
                if answer.status_code != 503:
                    first_success = time.monotonic() - back_at
                    break
                await asyncio.sleep(0.05)
            after = [await timed(http, t, k) for t, k in recorded.items()]
            retried = [await timed(http, t, f"during-{n}") for n, t in enumerate(gone)]
            caught_retry = await _past_409(http, gone[0], "caught")
    finally:
        process.stop()
        if cluster.postmaster(1) is None:
            cluster.start_node(1)

    # The doomed worker's tenants: 503 with Retry-After, never run.
    assert [a.status_code for a, _ in during_gone] == [503] * len(during_gone)
    assert all("retry-after" in a.headers for a, _ in during_gone)
    assert caught_answer.status_code == 503
    # Everyone else: unharmed (new keys run once; replays replay).
    assert [a.status_code for a, _ in during_kept] == [201] * len(during_kept)
    assert all(a.headers.get("idempotent-replayed") == "true" for a, _ in during_kept[3:])
    # Back: what was recorded before is still there, byte for byte...
    assert [a.status_code for a, _ in after] == [201] * len(after)
    assert all(a.headers.get("idempotent-replayed") == "true" for a, _ in after)
    assert [a.content for a, _ in after] == [a.content for a, _ in before]
    # ...the keys refused during the outage run now, once...
    assert [a.status_code for a, _ in retried] == [201] * len(retried)
    assert caught_retry.status_code == 201
    for n, tenant in enumerate(gone):
        assert await effects(odb, tenant, f"during-{n}") == 1
        assert await effects(odb, tenant, recorded[tenant]) == 1
    # ...and the request caught mid-handler left nothing: its retry's effect is the only one.
    assert await effects(odb, gone[0], "caught") == 1
    slowest_503 = max(seconds for _, seconds in during_gone)
    kept_seconds = sorted(seconds for _, seconds in during_kept)
    print(
        f"\n[{mode}] worker killed: {len(during_gone)} requests of its tenants answered 503,"
        f" the slowest in {slowest_503:.3f} s (timeout {TIMEOUT} s);"
        f" the other worker's {len(during_kept)} requests meanwhile: median"
        f" {kept_seconds[len(kept_seconds) // 2] * 1000:.1f} ms;"
        f" first success {first_success:.3f} s after the worker's restart"
        f" ({back_at - killed_at:.1f} s after the kill)"
    )


async def _past_409(http: httpx.AsyncClient, tenant: str, key: str) -> Any:
    """The caught request's retry: in the two-phase mode its key may be in flight until its
    (2 s) lease lapses, if its claim committed before the worker died."""
    for _ in range(100):
        answer, _ = await timed(http, tenant, key)
        if answer.status_code != 409:
            return answer
        await asyncio.sleep(0.1)
    raise AssertionError("still 409 after 10 s")


def _signal_node(cluster: Any, node: int, signum: int) -> None:
    from tests.server import child_pids

    pid = cluster.postmaster(node)
    assert pid is not None
    for each in [pid, *child_pids(pid)]:
        os.kill(each, signum)


async def test_a_worker_that_hangs_and_resumes(own_cluster, odb):
    """A worker that stops answering without refusing (SIGSTOP: a machine that hangs): its
    tenants' requests answer 503 once the store's timeout is spent, never anything else;
    when it resumes, nothing was lost and each refused key runs once. While its statements
    wait out their timeout they hold the store's statement connections, so requests of the
    other worker's tenants sent at the same moment may get 503 too (docs/scaling-out.md
    says so, with figures); once those statements gave up, they are served."""
    import signal as signals

    cluster = own_cluster
    gone = await tenants_on(odb, cluster.port + 1, 3, "hung")
    kept = await tenants_on(odb, cluster.port + 2, 3, "fine")
    process = serve(cluster, "atomic")
    try:
        async with httpx.AsyncClient(base_url=process.url, timeout=30) as http:
            before = [await timed(http, t, "before") for t in gone + kept]
            assert [a.status_code for a, _ in before] == [201] * 6
            _signal_node(cluster, 1, signals.SIGSTOP)
            try:
                wave = await asyncio.gather(
                    *(timed(http, t, f"hung-{n}") for n, t in enumerate(gone)),
                    *(timed(http, t, f"hung-{n}") for n, t in enumerate(kept)),
                )
                later = [await timed(http, t, f"later-{n}") for n, t in enumerate(kept)]
            finally:
                _signal_node(cluster, 1, signals.SIGCONT)
            await asyncio.sleep(0.5)
            after = [await timed(http, t, "before") for t in gone + kept]
            retried = [await timed(http, t, f"hung-{n}") for n, t in enumerate(gone + kept)]
    finally:
        process.stop()
    hung, others = wave[:3], wave[3:]
    assert [a.status_code for a, _ in hung] == [503] * 3
    assert all(a.status_code in (201, 503) for a, _ in others)
    assert [a.status_code for a, _ in later] == [201] * 3
    assert all(a.headers.get("idempotent-replayed") == "true" for a, _ in after)
    assert [a.content for a, _ in after] == [a.content for a, _ in before]
    assert all(a.status_code == 201 for a, _ in retried)
    for n, tenant in enumerate(gone + kept):
        assert await effects(odb, tenant, f"hung-{n % 3}") == 1
    print(
        f"\n[hung worker] its tenants: 503 after {max(s for _, s in hung):.2f} s"
        f" (timeout {TIMEOUT} s); the other worker's, sent at the same moment:"
        f" {sum(a.status_code == 201 for a, _ in others)} of 3 served,"
        f" {sum(a.status_code == 503 for a, _ in others)} 503 after"
        f" {max(s for _, s in others):.2f} s; sent after: 201 in"
        f" {max(s for _, s in later) * 1000:.0f} ms at most"
    )
