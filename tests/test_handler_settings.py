"""A handler sets up its own transaction as real ones do: REPEATABLE READ or SERIALIZABLE, READ
ONLY, a schema of the tenant's on its search_path. The key row is completed inside that same
transaction, so none of it may break the completion. Real PostgreSQL, audited afterwards."""

from __future__ import annotations

import asyncio

import pytest

from tests import modes
from tests.apps import build_app
from tests.helpers import client, effects, headers, key_row, new_key, running


@modes.two_phase  # a handler sets its own isolation level: the atomic mode's is configured
@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
async def test_a_slow_handler_at_a_strict_isolation_level_commits_under_its_heartbeat(
    schema, db, tenant, isolation
):
    # A 1.5 s lease is renewed every 0.5 s: four renewals land while the handler sleeps
    # 2.2 s inside its snapshot. Renewals that rewrote the key row made the completion
    # fail ("could not serialize access") on every attempt, so the request could never
    # succeed; they go to the lease table now.
    app = build_app(schema, lease_seconds=1.5)
    key = new_key()
    slow = headers(tenant, key, x_isolation=isolation, x_delay_ms="2200")
    async with client(app) as http:
        first = await http.post("/tx/settings", json={}, headers=slow)
        retry = await http.post("/tx/settings", json={}, headers=slow)
    assert first.status_code == 201, first.text
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    renewed = await db.fetchval(
        "SELECT count(*) FROM idempotency_leases WHERE tenant_id = $1 AND idempotency_key = $2",
        tenant,
        key,
    )
    assert renewed == 1  # it was renewed, or this test proves nothing
    assert await effects(db, tenant, key) == 1


@modes.two_phase
async def test_a_duplicate_waiting_on_a_repeatable_read_handler_does_not_break_it(
    schema, db, tenant
):
    # A waiting duplicate marks the key; that mark used to rewrite the key row too.
    app = build_app(schema, wait_seconds=10)
    key = new_key()
    slow = headers(tenant, key, x_isolation="REPEATABLE READ", x_delay_ms="800")
    async with client(app) as http:
        first = asyncio.create_task(http.post("/tx/settings", json={}, headers=slow))
        await running(db, tenant, key)
        duplicate = await http.post("/tx/settings", json={}, headers=slow)
        original = await first
    assert original.status_code == 201, original.text
    assert duplicate.status_code == 201 and duplicate.headers["idempotent-replayed"] == "true"
    assert duplicate.content == original.content
    assert await effects(db, tenant, key) == 1


async def test_a_read_only_transaction_records_its_answer_on_its_own(schema, db, tenant):
    # The completion cannot be written in a READ ONLY transaction; nor could anything else,
    # so there are no writes to keep together with it: the answer is recorded on its own.
    app = build_app(schema)
    key = new_key()
    look = headers(tenant, key, x_read_only="1", x_status="200")
    async with client(app) as http:
        first = await http.post("/tx/settings", json={}, headers=look)
        retry = await http.post("/tx/settings", json={}, headers=look)
    assert first.status_code == 200, first.text
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    assert (await key_row(db, tenant, key))["response_status"] == 200


async def test_a_handler_on_its_tenants_schema_still_completes_its_key(schema, db, tenant):
    # `SET LOCAL search_path` to a schema of the tenant's: the completion names its tables
    # with their own schema, so it neither misses them nor finds a tenant's look-alike.
    await db.execute(
        """
        CREATE SCHEMA IF NOT EXISTS tenant_space;
        CREATE TABLE IF NOT EXISTS tenant_space.effects (LIKE public.effects INCLUDING ALL);
        CREATE TABLE IF NOT EXISTS tenant_space.idempotency_keys (LIKE public.idempotency_keys);
        """
    )
    app = build_app(schema)
    key = new_key()
    scoped = headers(tenant, key, x_search_path="tenant_space")
    async with client(app) as http:
        first = await http.post("/tx/settings", json={}, headers=scoped)
        retry = await http.post("/tx/settings", json={}, headers=scoped)
    assert first.status_code == 201, first.text
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    written = await db.fetchval(
        "SELECT count(*) FROM tenant_space.effects WHERE tenant = $1 AND idempotency_key = $2",
        tenant,
        key,
    )
    assert written == 1
    assert await db.fetchval("SELECT count(*) FROM tenant_space.idempotency_keys") == 0
