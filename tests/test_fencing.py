"""The lease token fences a completion: an owner whose lease lapsed and was taken over can
never record its answer, whether it finishes before the request that took the key over or
after it. (Only the takeover's token matches the row while it runs; only an unfinished row
can be completed once it has finished.) Real PostgreSQL, through the store and over HTTP."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from idempotency_asgi import PostgresStore
from idempotency_asgi._records import Outcome, StoredResponse
from tests.apps import build_app
from tests.helpers import claimed, client, effects, eventually, headers, key_row, new_key

FP = hashlib.sha256(b"fenced request").digest()
STALE = StoredResponse(status=201, headers=[], body=b"stale")
TAKEOVER = StoredResponse(status=201, headers=[], body=b"takeover")


@pytest.fixture
async def store(schema):
    store = PostgresStore(schema)
    yield store
    await store.close()


async def _stale_and_takeover(store, tenant, key):
    """A lease that lapsed (its owner paused), and the retry that took the key over."""
    claim = dict(tenant=tenant, key=key, method="POST", path="/p", fingerprint=FP, ttl_seconds=60.0)
    stale = await store.claim(**claim, lease_seconds=0.2)
    await asyncio.sleep(0.3)
    taken = await store.claim(**claim, lease_seconds=30.0)
    assert taken.outcome is Outcome.TAKEN_OVER
    return stale.lease, taken.lease


async def test_a_stale_owner_finishing_first_cannot_complete(store, db, tenant):
    key = new_key()
    stale, takeover = await _stale_and_takeover(store, tenant, key)
    assert await store.complete(stale, STALE, ttl_seconds=60) is None
    row = await key_row(db, tenant, key)
    assert row["state"] == "in_flight" and row["lease_token"] == takeover.token
    assert await store.complete(takeover, TAKEOVER, ttl_seconds=60) is not None
    assert bytes((await key_row(db, tenant, key))["response_body"]) == b"takeover"


async def test_a_stale_owner_finishing_last_cannot_complete(store, db, tenant):
    key = new_key()
    stale, takeover = await _stale_and_takeover(store, tenant, key)
    assert await store.complete(takeover, TAKEOVER, ttl_seconds=60) is not None
    assert await store.complete(stale, STALE, ttl_seconds=60) is None
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed" and bytes(row["response_body"]) == b"takeover"


async def _race(http, db, tenant, key, path):
    """The first request's lease lapses while it runs (a pause longer than the lease); a
    retry takes the key over and is still running when the first one finishes."""
    first = asyncio.create_task(
        http.post(path, json={}, headers=headers(tenant, key, x_delay_ms="800"))
    )
    stale_token = (await claimed(db, tenant, key))["lease_token"]
    await db.execute(
        "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'"
        " WHERE tenant_id = $1 AND idempotency_key = $2",
        tenant,
        key,
    )
    takeover = asyncio.create_task(
        http.post(path, json={}, headers=headers(tenant, key, x_delay_ms="2000"))
    )

    async def taken_over():
        row = await key_row(db, tenant, key)
        return row if row["lease_token"] != stale_token else None

    await eventually(taken_over)
    stale = await first
    between = await key_row(db, tenant, key)  # the stale owner is done, the takeover is not
    winner = await takeover
    replay = await http.post(path, json={}, headers=headers(tenant, key))
    return stale, between, winner, replay


async def test_a_stale_transactional_owner_finishing_first_rolls_back_and_is_told(
    schema, db, tenant
):
    app = build_app(schema, lease_seconds=30)
    key = new_key()
    async with client(app) as http:
        stale, between, winner, replay = await _race(http, db, tenant, key, "/tx/charge")
    assert stale.status_code == 409 and stale.json()["type"].endswith(":lease-lost")
    assert between["state"] == "in_flight"  # the stale owner recorded nothing
    assert winner.status_code == 201
    assert replay.content == winner.content and replay.headers["idempotent-replayed"] == "true"
    # The stale owner's write rolled back: only the takeover's is there.
    assert await effects(db, tenant, key) == 1
    survivor = await db.fetchval(
        "SELECT id FROM effects WHERE tenant = $1 AND idempotency_key = $2", tenant, key
    )
    assert survivor == winner.json()["effect_id"]


async def test_a_stale_plain_owner_finishing_first_does_not_become_the_record(schema, db, tenant):
    app = build_app(schema, lease_seconds=30)
    key = new_key()
    async with client(app) as http:
        stale, between, winner, replay = await _race(http, db, tenant, key, "/plain/charge")
    # Plain mode: the stale owner's effect happened and its client hears so; but the record,
    # and every replay, are the takeover's.
    assert stale.status_code == 201 and "idempotency-key-expires" not in stale.headers
    assert between["state"] == "in_flight"
    assert winner.status_code == 201 and winner.content != stale.content
    assert replay.content == winner.content and replay.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 2
