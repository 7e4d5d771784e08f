"""The store's maintenance calls take one bounded batch each (the sweeper's release of lapsed
leases, the forgetting of old lease rows, the reaping of old consumer records), and `inspect`
reads one tenant's key and no other. On a database of their own, so counts are exact."""

from __future__ import annotations

import hashlib

import asyncpg
import pytest

from idempotency_asgi import PostgresStore, migrate
from idempotency_asgi._records import Outcome, StoredResponse
from tests.helpers import fresh_database

FP = hashlib.sha256(b"maintained").digest()


@pytest.fixture
async def empty(schema):
    async with fresh_database(schema) as url:
        await migrate(url)
        store = PostgresStore(url)
        conn = await asyncpg.connect(url)
        try:
            yield store, conn
        finally:
            await conn.close()
            await store.close()


async def _claim(store, key, tenant="t"):
    claim = await store.claim(
        tenant=tenant,
        key=key,
        method="POST",
        path="/p",
        fingerprint=FP,
        lease_seconds=30.0,
        ttl_seconds=3600.0,
    )
    assert claim.outcome is Outcome.CLAIMED
    return claim.lease


async def test_the_sweep_releases_one_bounded_batch_at_a_time(empty):
    store, conn = empty
    for n in range(5):
        await _claim(store, f"k{n}")
    await conn.execute("UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 hour'")
    batches = [len(await store.sweep(batch_size=2, grace_seconds=60)) for _ in range(4)]
    assert batches == [2, 2, 1, 0]


async def test_old_lease_rows_are_forgotten_one_bounded_batch_at_a_time(empty):
    store, conn = empty
    for n in range(3):
        lease = await _claim(store, f"k{n}")
        assert await store.renew(lease)  # a renewal writes a lease row
        assert await store.complete(lease, StoredResponse(201, [], b"{}"), ttl_seconds=60)
    await conn.execute("UPDATE idempotency_leases SET lease_expires_at = now() - interval '1 hour'")
    forgotten = [await store.forget_leases(batch_size=2, grace_seconds=60) for _ in range(3)]
    assert forgotten == [2, 1, 0]


async def test_old_consumer_records_are_reaped_one_bounded_batch_at_a_time(empty):
    store, conn = empty
    await conn.execute(
        "INSERT INTO idempotency_processed_messages (consumer, message_id, processed_at)"
        " SELECT 'c', 'm' || n, now() - interval '2 days' FROM generate_series(1, 3) AS n"
    )
    reaped = [await store.reap_processed(batch_size=2, retention_seconds=86400) for _ in range(3)]
    assert reaped == [2, 1, 0]


async def test_inspect_reads_one_tenants_key(empty):
    store, _ = empty
    await _claim(store, "shared", tenant="acme")
    await _claim(store, "other", tenant="acme")
    row = await store.inspect(tenant="acme", key="shared")
    assert row is not None
    assert (row["tenant_id"], row["idempotency_key"], row["state"]) == (
        "acme",
        "shared",
        "in_flight",
    )
    assert row["fingerprint"] == FP.hex() and row["lease_live"] is True
    assert await store.inspect(tenant="globex", key="shared") is None
    assert await store.inspect(tenant="acme", key="missing") is None
