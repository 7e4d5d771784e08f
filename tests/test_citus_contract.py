"""The contract on a Citus cluster, against the coordinator: the tests' app served by real
uvicorn processes in the plain, two-phase transactional and atomic modes, the key tables and
the app's tables distributed by tenant and co-located (tests/citus_cluster.py), the database
audited afterwards. Where a request's transaction ran is read from the coordinator's own log
of what it sent to the workers (`citus.log_remote_commands`)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from idempotency_asgi._postgres import sql
from idempotency_asgi._postgres.keyhash import key_lock
from tests import server
from tests.citus_cluster import log_of, logged_remote_commands, worker_of
from tests.helpers import effects, eventually, headers, key_row, new_key
from tests.server import UvicornProcess, wire

pytestmark = pytest.mark.citus

MODES = ("plain", "two_phase", "atomic")
ROUTE = {"plain": "/plain/charge", "two_phase": "/tx/charge", "atomic": "/tx/charge"}


def serve(
    citus: Any, mode: str, *, lease_seconds: float = 10, store: dict | None = None, **options
) -> UvicornProcess:
    return server.serve(
        citus.coordinator,
        store=store,
        options={"atomic": mode == "atomic", **options},
        IDEMPOTENCY_LEASE_SECONDS=str(lease_seconds),
    )


@pytest.fixture(scope="module")
async def cdb(citus: Any) -> AsyncIterator[asyncpg.Pool]:
    """The tests' own pool on the coordinator, for audits."""
    pool = await asyncpg.create_pool(citus.coordinator, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture(scope="module", params=MODES)
def served(request: pytest.FixtureRequest, citus: Any) -> Any:
    process = serve(citus, request.param)
    process.mode = request.param  # type: ignore[attr-defined]
    yield process
    process.stop()


async def running(db: asyncpg.Pool, tenant: str, key: str) -> None:
    """Until a request with this key runs: its row is there, or its key's lock is held (the
    atomic mode) on the worker of its tenant, where LOCK_FREE looks."""

    async def found() -> bool:
        if await key_row(db, tenant, key) is not None:
            return True
        return not await db.fetchval(sql.LOCK_FREE, tenant, key, key_lock(tenant, key), None)

    await eventually(found)


# -- the contract ---------------------------------------------------------------------------


async def test_new_key_replay_409_and_422(served, cdb, tenant):
    path = ROUTE[served.mode]
    key, slow_key = new_key(), new_key()
    async with wire(served.url) as http:
        first = await http.post(path, json={"amount": 1}, headers=headers(tenant, key))
        replay = await http.post(path, json={"amount": 1}, headers=headers(tenant, key))
        other = await http.post(path, json={"amount": 2}, headers=headers(tenant, key))
        slow = asyncio.create_task(
            http.post(path, json={}, headers=headers(tenant, slow_key, x_delay_ms="1500"))
        )
        await running(cdb, tenant, slow_key)
        conflict = await http.post(path, json={}, headers=headers(tenant, slow_key))
        slow_answer = await slow
    assert first.status_code == 201, first.text
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content  # byte for byte
    assert replay.headers["x-custom"] == "kept"
    assert other.status_code == 422
    assert conflict.status_code == 409 and int(conflict.headers["retry-after"]) >= 1
    assert slow_answer.status_code == 201
    assert await effects(cdb, tenant, key) == 1
    assert await effects(cdb, tenant, slow_key) == 1


async def test_forty_concurrent_duplicates_make_one_effect(served, cdb, tenant):
    path, key = ROUTE[served.mode], new_key()
    async with wire(served.url) as http:
        answers = await asyncio.gather(
            *(
                http.post(path, json={}, headers=headers(tenant, key, x_delay_ms="300"))
                for _ in range(40)
            )
        )
        replay = await http.post(path, json={}, headers=headers(tenant, key))
    statuses = Counter(a.status_code for a in answers)
    assert statuses[201] >= 1 and set(statuses) <= {201, 409}, statuses
    assert statuses[409] >= 1  # they really overlapped
    originals = {a.content for a in answers if a.status_code == 201}
    assert originals == {replay.content} and replay.headers["idempotent-replayed"] == "true"
    assert await effects(cdb, tenant, key) == 1


async def test_tenants_are_independent_across_workers(served, cdb, citus):
    """One key, a tenant on each worker: two independent records, two effects."""
    path, key = ROUTE[served.mode], new_key()
    ports = {citus.port + 1, citus.port + 2}
    tenants: dict[int, str] = {}
    while set(tenants) != ports:
        tenant = f"t-{uuid.uuid4().hex[:12]}"
        tenants.setdefault(await worker_of(cdb, tenant), tenant)
    async with wire(served.url) as http:
        answers = [
            await http.post(path, json={}, headers=headers(tenant, key))
            for tenant in tenants.values()
        ]
    assert [a.status_code for a in answers] == [201, 201]
    assert "idempotent-replayed" not in answers[1].headers
    for tenant in tenants.values():
        assert await effects(cdb, tenant, key) == 1


# -- one transaction, on one worker ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["two_phase", "atomic"])
async def test_the_handlers_writes_and_the_record_commit_on_one_worker_in_one_phase(
    citus, cdb, tenant, mode
):
    """The coordinator's log of what it sent the workers, for this app's sessions only: the
    handler's INSERT into effects and the key's record (COMPLETE's UPDATE, or the atomic
    RECORD) go over one connection to the worker of the tenant, and end in a plain COMMIT
    there: no PREPARE TRANSACTION, on the request path or anywhere else."""
    application = f"contract-{mode}-{uuid.uuid4().hex[:6]}"
    settings = {
        "application_name": application,
        "citus.log_remote_commands": "on",  # a NOTICE for each command sent to a worker...
        "log_min_messages": "notice",  # ...written to the coordinator's log
    }
    process = serve(citus, mode, store={"pool_options": {"server_settings": settings}})
    keys = [new_key() for _ in range(5)]
    try:
        async with wire(process.url) as http:
            for key in keys:
                answer = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
                assert answer.status_code == 201, answer.text
    finally:
        process.stop()
    worker = f"127.0.0.1:{await worker_of(cdb, tenant)}"
    sent = logged_remote_commands(log_of(citus), application)
    assert sent, "the coordinator logged nothing of this app's sessions"
    assert {where.split(" ", 1)[0] for _, where, _ in sent} == {worker}, sent
    assert not [command for _, _, command in sent if "PREPARE TRANSACTION" in command]
    assert not [command for _, _, command in sent if command.startswith("COPY")]
    for key in keys:
        # the connection (backend and Citus connection) that wrote the key's effect...
        written = [
            (pid, where)
            for pid, where, command in sent
            if command.startswith("INSERT INTO public.effects_") and key in command
        ]
        assert len(written) == 1, (key, sent)
        pid, where = written[0]
        after = [c for p, w, c in sent if (p, w) == (pid, where)]
        start = next(i for i, c in enumerate(after) if c.startswith("INSERT INTO public.effects_"))
        rest = after[start:]
        # ...then wrote its record, and committed, on the same connection
        record = next(i for i, c in enumerate(rest) if "idempotency_keys_" in c and key in c)
        assert rest[record + 1 :][:1] == ["COMMIT"], rest
    assert await effects(cdb, tenant) == len(keys)


# -- a server killed mid-handler ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["two_phase", "atomic"])
async def test_kill_9_of_the_app_mid_handler_leaves_one_effect_after_the_retry(
    citus, cdb, tenant, mode
):
    key = new_key()
    first = serve(citus, mode, lease_seconds=2)
    try:
        async with wire(first.url) as http:
            doomed = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="5000"))
            )
            await running(cdb, tenant, key)
            await asyncio.sleep(0.3)  # its effect is written, uncommitted, on the worker
            first.kill()
            with pytest.raises(httpx.TransportError):
                await doomed
    finally:
        first.stop()
    # The coordinator saw its client go; the worker's transaction rolled back with it.
    await eventually(lambda: _no_effect(cdb, tenant, key))
    second = serve(citus, mode, lease_seconds=2)
    try:
        async with wire(second.url) as http:
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            if mode == "two_phase":
                # the dead owner's key is in flight until its 2 s lease lapses: 409 until then
                assert retry.status_code == 409, retry.text
                retry = await _until_not_409(http, tenant, key)
            replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        second.stop()
    assert retry.status_code == 201, retry.text
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == retry.content
    assert await effects(cdb, tenant, key) == 1


async def _no_effect(db: asyncpg.Pool, tenant: str, key: str) -> bool:
    return await effects(db, tenant, key) == 0


async def _until_not_409(http: httpx.AsyncClient, tenant: str, key: str) -> httpx.Response:
    for _ in range(100):
        answer = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        if answer.status_code != 409:
            return answer
        await asyncio.sleep(0.1)
    raise AssertionError("still 409 after 10 s")


# -- duplicates that wait ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["two_phase", "atomic"])
async def test_waiting_duplicates_get_the_replay(citus, cdb, tenant, mode):
    """With wait_seconds, duplicates of a request in flight wait and get its replay. On the
    cluster the completion's NOTIFY is sent by the worker that runs it, where the store's
    listener (on the coordinator) does not hear it: a two-phase waiter is answered at its next
    look (they look again every second), an atomic one when its look at the key's lock, on
    the tenant's worker, finds it free (printed)."""
    process = serve(citus, mode, wait_seconds=3)
    key = new_key()
    try:
        async with wire(process.url) as http:
            first = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="500"))
            )
            await running(cdb, tenant, key)
            started = asyncio.get_running_loop().time()
            duplicates = await asyncio.gather(
                *(http.post("/tx/charge", json={}, headers=headers(tenant, key)) for _ in range(5))
            )
            waited = asyncio.get_running_loop().time() - started
            original = await first
    finally:
        process.stop()
    assert original.status_code == 201
    assert [d.status_code for d in duplicates] == [201] * 5
    assert all(d.headers["idempotent-replayed"] == "true" for d in duplicates)
    assert {d.content for d in duplicates} == {original.content}
    assert await effects(cdb, tenant, key) == 1
    print(f"\n[{mode}] duplicates waiting for a 0.5 s request got its replay after {waited:.2f} s")


# -- an application connected to a worker -----------------------------------------------------


async def test_servers_on_the_coordinator_and_on_a_worker_meet_at_the_same_lock(citus, cdb):
    """Citus lets any node take queries. The key's advisory lock is taken by statements
    routed to the worker that holds the tenant's shard, wherever they were sent: an atomic
    request served through the coordinator and its duplicate served through the other
    worker meet there (409 at once), and the key runs once."""
    tenant = (await _tenants_on_each_worker(cdb, citus))[citus.port + 1]
    on_coordinator = serve(citus, "atomic")
    elsewhere = server.serve(citus.url(2), options={"atomic": True})
    key = new_key()
    try:
        async with wire(on_coordinator.url) as first_http, wire(elsewhere.url) as other_http:
            first = asyncio.create_task(
                first_http.post(
                    "/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1500")
                )
            )
            await running(cdb, tenant, key)
            duplicate = await other_http.post("/tx/charge", json={}, headers=headers(tenant, key))
            original = await first
            replay = await other_http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        on_coordinator.stop()
        elsewhere.stop()
    assert original.status_code == 201
    assert duplicate.status_code == 409
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == original.content
    assert await effects(cdb, tenant, key) == 1


async def _tenants_on_each_worker(db: asyncpg.Pool, citus: Any) -> dict[int, str]:
    found: dict[int, str] = {}
    while len(found) < 2:
        tenant = f"t-{uuid.uuid4().hex[:12]}"
        found.setdefault(await worker_of(db, tenant), tenant)
    return found
