"""Real concurrent requests against a real uvicorn process, audited in the database."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from tests import modes
from tests.helpers import effects, eventually, headers, key_row, new_key, running
from tests.server import UvicornProcess


@pytest.fixture(scope="module")
def server(schema):
    process = UvicornProcess(
        "tests.apps:app",
        {"DATABASE_URL": schema, "TEST_APP_SERVE": "1", "IDEMPOTENCY_LEASE_SECONDS": "10"},
    ).start()
    yield process
    process.stop()


def wire_client(url: str, timeout: float = 30.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout)


def tally(responses: list[httpx.Response]) -> collections.Counter[str]:
    def kind(response: httpx.Response) -> str:
        if response.headers.get("idempotent-replayed") == "true":
            return f"replay-{response.status_code}"
        return str(response.status_code)

    return collections.Counter(kind(r) for r in responses)


@pytest.mark.parametrize("path", ["/tx/charge", "/plain/charge"])
async def test_sixty_concurrent_duplicates_run_the_handler_once(server, db, tenant, path):
    key = new_key()
    request_headers = headers(tenant, key, x_delay_ms="300")
    async with wire_client(server.url) as http:
        responses = await asyncio.gather(
            *(http.post(path, json={"amount": 100}, headers=request_headers) for _ in range(60))
        )
        replay = await http.post(path, json={"amount": 100}, headers=request_headers)
    counts = tally(responses)
    assert counts["201"] == 1, counts
    assert counts["409"] + counts["replay-201"] == 59, counts
    assert counts["409"] >= 1, counts  # they really overlapped
    original = next(
        r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers
    )
    assert replay.content == original.content
    for response in responses:
        if response.status_code == 409:
            assert response.headers["content-type"] == "application/problem+json"
            assert 1 <= int(response.headers["retry-after"]) <= 10
    assert await effects(db, tenant, key) == 1
    assert (await key_row(db, tenant, key))["state"] == "completed"


async def test_sixty_concurrent_replays_of_a_hot_key_are_all_clean(server, db, tenant):
    key = new_key()
    async with wire_client(server.url) as http:
        first = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
        replays = await asyncio.gather(
            *(
                http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
                for _ in range(60)
            )
        )
    assert all(r.status_code == 201 for r in replays), tally(replays)
    assert all(r.headers["idempotent-replayed"] == "true" for r in replays)
    assert all(r.content == first.content for r in replays)
    assert await effects(db, tenant, key) == 1


async def test_many_keys_at_once_each_run_exactly_once(server, db, tenant):
    keys = [new_key() for _ in range(20)]
    async with wire_client(server.url) as http:
        responses = await asyncio.gather(
            *(
                http.post(
                    "/tx/charge", json={"k": key}, headers=headers(tenant, key, x_delay_ms="50")
                )
                for key in keys
                for _ in range(3)
            )
        )
    assert all(r.status_code in (201, 409) for r in responses), tally(responses)
    rows = await db.fetch(
        "SELECT idempotency_key, count(*) AS n FROM effects WHERE tenant = $1"
        " GROUP BY idempotency_key",
        tenant,
    )
    assert {row["idempotency_key"]: row["n"] for row in rows} == dict.fromkeys(keys, 1)


async def test_client_disconnect_still_records_and_the_retry_gets_the_replay(server, db, tenant):
    key = new_key()
    request_headers = headers(tenant, key, x_delay_ms="700")
    async with wire_client(server.url, timeout=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/tx/charge", json={"a": 1}, headers=request_headers)
    # The client hung up mid-request. The server finishes the request and records it.
    for _ in range(100):
        row = await key_row(db, tenant, key)
        if row is not None and row["state"] == "completed":
            break
        await asyncio.sleep(0.05)
    async with wire_client(server.url) as http:
        retry = await http.post("/tx/charge", json={"a": 1}, headers=request_headers)
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


async def test_response_is_sent_and_recorded_before_background_tasks_run(server, db, tenant):
    key = new_key()
    async with wire_client(server.url) as http:
        response = await http.post("/background", headers=headers(tenant, key))
        # The background task sleeps 1.5 s before it writes: it cannot have run yet.
        paths_now = await db.fetch(
            "SELECT path FROM effects WHERE tenant = $1 AND idempotency_key = $2", tenant, key
        )
        row_now = await key_row(db, tenant, key)
        for _ in range(100):
            paths = await db.fetch("SELECT path FROM effects WHERE tenant = $1 ORDER BY id", tenant)
            if len(paths) == 2:
                break
            await asyncio.sleep(0.05)
    assert response.status_code == 201 and response.content == b"done"
    assert [r["path"] for r in paths_now] == ["handler"]
    assert row_now["state"] == "completed"
    # ...and the transaction ended with the response: the task could not write through it.
    assert [r["path"] for r in paths] == ["handler", "background"]


@modes.two_phase
@pytest.mark.slow
async def test_crash_mid_request_is_taken_over_and_runs_once(schema, db, tenant):
    env = {"DATABASE_URL": schema, "TEST_APP_SERVE": "1", "IDEMPOTENCY_LEASE_SECONDS": "1"}
    key = new_key()
    request_headers = headers(tenant, key, x_delay_ms="5000")
    first = UvicornProcess("tests.apps:app", env).start()
    try:
        async with wire_client(first.url) as http:
            doomed = asyncio.create_task(
                http.post("/tx/charge", json={"a": 1}, headers=request_headers)
            )
            await running(db, tenant, key)
            await asyncio.sleep(0.3)  # the handler has written, inside its transaction
            first.kill()
            with pytest.raises(httpx.TransportError):
                await doomed
    finally:
        first.stop()
    row = await key_row(db, tenant, key)
    assert row["state"] == "in_flight"  # the reservation survived the crash...
    assert await effects(db, tenant, key) == 0  # ...the uncommitted business write did not

    second = UvicornProcess("tests.apps:app", env, port=first.port).start()
    try:
        statuses = []
        async with wire_client(second.url) as http:
            for _ in range(100):
                response = await http.post(
                    "/tx/charge", json={"a": 1}, headers=headers(tenant, key, x_delay_ms="0")
                )
                statuses.append(response.status_code)
                if response.status_code != 409:
                    break
                await asyncio.sleep(min(float(response.headers["retry-after"]), 0.2))
            replay = await http.post("/tx/charge", json={"a": 1}, headers=request_headers)
    finally:
        second.stop()
    assert statuses[-1] == 201, statuses
    assert set(statuses[:-1]) <= {409}
    assert replay.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1
    assert (await key_row(db, tenant, key))["lease_token"] != row["lease_token"]


@modes.two_phase
@pytest.mark.slow
async def test_keys_whose_owner_died_do_not_count_against_the_tenant_cap(schema, db, tenant):
    env = {
        "DATABASE_URL": schema,
        "TEST_APP_SERVE": "1",
        "IDEMPOTENCY_LEASE_SECONDS": "1",
        "TEST_APP_OPTIONS": json.dumps({"max_in_flight_per_tenant": 2}),
    }
    dead_keys = [new_key(), new_key()]
    first = UvicornProcess("tests.apps:app", env).start()
    try:
        async with wire_client(first.url) as http:
            doomed = [
                asyncio.create_task(
                    http.post(
                        "/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="9000")
                    )
                )
                for key in dead_keys
            ]
            for key in dead_keys:
                await running(db, tenant, key)
            capped = await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
            first.kill()
            for task in doomed:
                with pytest.raises(httpx.TransportError):
                    await task
    finally:
        first.stop()
    assert capped.status_code == 429  # while both lived, the cap held
    second = UvicornProcess("tests.apps:app", env, port=first.port).start()
    try:
        # Nobody renews the dead leases: they lapse within a second.
        live = (
            "SELECT count(*) FROM idempotency_keys"
            " WHERE tenant_id = $1 AND state = 'in_flight' AND lease_expires_at > now()"
        )
        await eventually(lambda: _is_zero(db.fetchval(live, tenant)))
        async with wire_client(second.url) as http:
            fresh = await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
    finally:
        second.stop()
    assert fresh.status_code == 201, fresh.text
    # The dead keys were neither retried nor swept: they are still rows in flight.
    for key in dead_keys:
        assert (await key_row(db, tenant, key))["state"] == "in_flight"


async def _is_zero(count) -> bool:
    return await count == 0
