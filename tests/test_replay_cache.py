"""The cache of finished records (`PostgresStore(replay_cache_seconds=...)`): replays without
a round trip, only of the same request, never past their retention, for no longer than asked,
in the memory given. Real PostgreSQL; statements counted at the driver."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_asgi import PostgresStore
from tests.apps import build_app
from tests.helpers import client, effects, headers, new_key
from tests.test_store import QueryCounter


def cached_store(schema: str, counter: QueryCounter, **options) -> PostgresStore:
    return PostgresStore(schema, pool_options={"init": counter.init}, **options)


@pytest.mark.parametrize("atomic", [False, True], ids=["claim", "atomic"])
async def test_replays_of_a_record_read_lately_cost_no_statement(schema, db, tenant, atomic):
    counter = QueryCounter()
    store = cached_store(schema, counter, replay_cache_seconds=30)
    app = build_app(schema, store=store, atomic=atomic)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        read = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await counter.count()
        counter.queries.clear()
        kept = [
            await http.post("/tx/charge", json={}, headers=headers(tenant, key)) for _ in range(5)
        ]
        cost = await counter.count()
        other = await http.post("/tx/charge", json={"x": 1}, headers=headers(tenant, key))
    assert cost == 0  # five replays, no statement
    for replay in (read, *kept):
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.content == first.content
        assert replay.headers["idempotency-key-expires"] == first.headers["idempotency-key-expires"]
    assert other.status_code == 422  # another request on the key: the database answers it
    assert store.replays is not None and store.replays.hits == 5
    assert await effects(db, tenant, key) == 1


async def test_a_record_deleted_by_hand_is_replayed_no_longer_than_asked(schema, db, tenant):
    store = PostgresStore(schema, replay_cache_seconds=0.5)
    app = build_app(schema, store=store)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))  # read: kept
        await db.execute(
            "DELETE FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2",
            tenant,
            key,
        )
        meanwhile = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await asyncio.sleep(0.6)
        after = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert meanwhile.headers["idempotent-replayed"] == "true"  # within the half second asked
    assert meanwhile.content == first.content
    assert after.status_code == 201 and "idempotent-replayed" not in after.headers  # runs again
    assert await effects(db, tenant, key) == 2


async def test_a_record_whose_retention_ends_within_the_cache_time_is_not_kept(schema, tenant):
    counter = QueryCounter()
    store = cached_store(schema, counter, replay_cache_seconds=30)
    app = build_app(schema, store=store, ttl_seconds=20)
    key = new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await counter.count()
        counter.queries.clear()
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        cost = await counter.count()
    assert replay.headers["idempotent-replayed"] == "true"
    assert cost == 1  # asked the database: it would expire before it left the cache


async def test_the_cache_keeps_to_its_memory(schema, tenant):
    store = PostgresStore(schema, replay_cache_seconds=30, replay_cache_bytes=64 * 1024)
    app = build_app(schema, store=store)
    async with client(app) as http:
        for _ in range(40):
            key = new_key()
            await http.post("/big?size=4000", headers=headers(tenant, key))
            await http.post("/big?size=4000", headers=headers(tenant, key))
    cache = store.replays
    assert cache is not None
    assert 0 < cache._bytes <= 64 * 1024
    assert len(cache._entries) < 40  # the oldest went first


async def test_there_is_no_cache_unless_asked_for(schema, db, tenant):
    counter = QueryCounter()
    store = cached_store(schema, counter)
    app = build_app(schema, store=store)
    key = new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await counter.count()
        counter.queries.clear()
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        cost = await counter.count()
    assert store.replays is None and cost == 1


def test_the_cache_time_must_be_a_finite_number():
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="replay_cache_seconds"):
            PostgresStore("postgresql://unused", replay_cache_seconds=bad)
