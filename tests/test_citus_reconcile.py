"""Reconciliation on a Citus cluster: held keys listed (one tenant's shard, and every shard),
settled and released, and a running atomic request (its locks on the tenant's worker) never
raced, with tenants on both workers. The handler's effects are counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idempotency_asgi import KeyRunning, PostgresStore
from tests.apps import build_app
from tests.citus_cluster import tenants_on
from tests.helpers import assert_problem, client, effects, headers, new_key, running

pytestmark = pytest.mark.citus

CONFIRMED = b'{"charge": "ch_confirmed"}'


@pytest.fixture(scope="module")
async def cdb(citus: Any) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(citus.coordinator, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.mark.parametrize(("atomic", "path"), [(False, "/plain/charge"), (True, "/tx/charge")])
async def test_held_keys_are_settled_and_released_on_the_cluster(citus, cdb, atomic, path):
    tenants = [
        *(await tenants_on(cdb, citus.port + 1, 1, "rec")),
        *(await tenants_on(cdb, citus.port + 2, 1, "rec")),
    ]
    operator = PostgresStore(citus.coordinator)
    app = build_app(citus.coordinator, atomic=atomic, lease_seconds=30)
    try:
        async with client(app) as http:
            for tenant in tenants:
                settled, released = new_key(), new_key()
                for key in (settled, released):
                    unknown = await http.post(
                        path, json={}, headers=headers(tenant, key, x_unknown="1")
                    )
                    assert_problem(unknown, 504, "outcome-unknown")
                ran = await effects(cdb, tenant)
                listed = await operator.held(tenant=tenant)
                assert {(h.key, h.reason) for h in listed} == {
                    (settled, "outcome-unknown"),
                    (released, "outcome-unknown"),
                }
                assert {settled, released} <= {h.key for h in await operator.held()}

                await operator.settle(tenant=tenant, key=settled, status=201, body=CONFIRMED)
                await operator.release_key(tenant=tenant, key=released)
                replay = await http.post(path, json={}, headers=headers(tenant, settled))
                assert (replay.status_code, replay.content) == (201, CONFIRMED)
                assert replay.headers["idempotent-replayed"] == "true"
                runs = await http.post(path, json={}, headers=headers(tenant, released))
                assert runs.status_code == 201 and "idempotent-replayed" not in runs.headers
                assert await effects(cdb, tenant) == ran + 1
                assert await operator.held(tenant=tenant) == []

            # A running atomic request: no row yet, its lock on the tenant's worker.
            tenant, key = tenants[0], new_key()
            slow = asyncio.create_task(
                http.post(path, json={}, headers=headers(tenant, key, x_delay_ms="1000"))
            )
            if atomic:
                await asyncio.sleep(0.4)  # its lock is on the worker, where pg_locks is not read
            else:
                await running(cdb, tenant, key)
            with pytest.raises(KeyRunning):
                await operator.settle(tenant=tenant, key=key, status=201)
            assert (await slow).status_code == 201
            assert await effects(cdb, tenant, key) == 1
    finally:
        await operator.close()
