"""Natural batching: under load the store's statements carry many requests' rows, and each
request keeps its own fate. Counted at the driver (asyncpg's query logger), on real
PostgreSQL, over HTTP where it matters."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from idempotency_asgi import PostgresStore, StoreRefused
from idempotency_asgi._records import Outcome
from tests import batching
from tests.apps import build_app
from tests.helpers import client, effects, eventually, headers, key_row, new_key
from tests.test_store import QueryCounter

# These tests make their stores' batching what they test: not what the suite forces.
pytestmark = pytest.mark.skipif(
    bool(batching.mode()), reason=f"{batching.VARIABLE} is set: these set batching themselves"
)


def statements(counter: QueryCounter, text: str) -> int:
    return sum(text in query for query in counter.queries)


CLAIMS = "INSERT INTO idempotency_keys"
COMPLETIONS = "SET state = 'completed'"


@pytest.mark.parametrize("batch", [True, False], ids=["batching", "one-per-request"])
async def test_concurrent_new_keys_share_their_claims_and_completions(schema, db, tenant, batch):
    counter = QueryCounter()
    store = PostgresStore(schema, batch=batch, pool_options={"init": counter.init})
    app = build_app(schema, store=store)
    keys = [new_key() for _ in range(40)]
    async with client(app) as http:
        await http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))  # warm
        await counter.count()
        counter.queries.clear()
        answers = await asyncio.gather(
            *(http.post("/plain/charge", json={}, headers=headers(tenant, key)) for key in keys)
        )
        await counter.count()
        claims, completions = statements(counter, CLAIMS), statements(counter, COMPLETIONS)
        replays = await asyncio.gather(
            *(http.post("/plain/charge", json={}, headers=headers(tenant, key)) for key in keys)
        )
    assert [a.status_code for a in answers] == [201] * 40
    assert all(r.headers["idempotent-replayed"] == "true" for r in replays)
    assert [r.content for r in replays] == [a.content for a in answers]
    for key in keys:
        assert await effects(db, tenant, key) == 1
        assert (await key_row(db, tenant, key))["state"] == "completed"
    if batch:
        # Fewer statements than requests: the ones queued behind each share the next.
        # (Measured 3 to 6 claims and 6 to 11 completions on a quiet machine; on a loaded one
        # the completions, spread out by the handlers' own pool, find a lane free more often
        # and go alone: 21 seen with two more test runs on the same two cores.)
        assert claims <= 40 / 2 and completions < 40, (claims, completions)
    else:
        assert (claims, completions) == (40, 40)


async def test_a_lone_request_runs_the_one_row_statement_without_waiting(schema, tenant):
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    app = build_app(schema, store=store)
    async with client(app) as http:
        await http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))
        await counter.count()
        counter.queries.clear()
        await http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))
        await counter.count()
    # The same two statements a request always ran, neither of them an array's.
    assert len(counter.queries) == 2
    assert not any("unnest" in query for query in counter.queries)


@pytest.fixture
async def poisoned_key(db):
    """A key PostgreSQL refuses to store (a trigger of the test's raises for it): a row that
    fails its statement for good, whatever statement carries it."""
    poison = f"poison-{uuid.uuid4().hex[:8]}"
    function = f"refuse_{uuid.uuid4().hex[:8]}"
    await db.execute(
        f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " RAISE EXCEPTION 'this key is refused' USING ERRCODE = 'check_violation'; END $$"
    )
    await db.execute(
        f"CREATE TRIGGER {function} BEFORE INSERT ON idempotency_keys FOR EACH ROW"
        f" WHEN (NEW.idempotency_key = '{poison}') EXECUTE FUNCTION {function}()"
    )
    yield poison
    await db.execute(f"DROP TRIGGER {function} ON idempotency_keys")
    await db.execute(f"DROP FUNCTION {function}()")


async def claim(store: PostgresStore, tenant: str, key: str):
    return await store.claim(
        tenant=tenant,
        key=key,
        method="POST",
        path="/x",
        fingerprint=b"f" * 32,
        lease_seconds=10,
        ttl_seconds=60,
    )


async def test_a_row_refused_for_good_fails_alone_not_its_batch(schema, tenant, poisoned_key):
    store = PostgresStore(schema)
    store._batchers()["claim"]._hold = 0.2  # the five share one statement
    keys = [new_key() for _ in range(4)]
    try:
        results = await asyncio.gather(
            *(claim(store, tenant, key) for key in [*keys[:2], poisoned_key, *keys[2:]]),
            return_exceptions=True,
        )
        sent, rows = store.batching()["claim"]
    finally:
        await store.close()
    refused = results.pop(2)
    assert isinstance(refused, StoreRefused) and "CheckViolationError (23514)" in refused.error
    assert [r.outcome for r in results] == [Outcome.CLAIMED] * 4
    # One statement for the five, which failed; then each of them alone, outside the
    # batcher's count (which counts what it sent: one statement, five rows).
    assert (sent, rows) == (1, 5)


async def test_a_request_that_leaves_its_batch_leaves_it_unharmed(schema, db, tenant):
    store = PostgresStore(schema, timeout=5)
    keys = [new_key() for _ in range(4)]
    try:
        await claim(store, tenant, new_key())  # open it, and its statement connections
        async with db.acquire() as blocker, blocker.transaction():
            # The claims' statement waits on this lock: its batch is in flight.
            await blocker.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            first = asyncio.create_task(claim(store, tenant, new_key()))  # in flight alone
            await asyncio.sleep(0.1)
            store._batchers()["claim"]._lanes = 1  # the rest queue as one
            tasks = [asyncio.create_task(claim(store, tenant, key)) for key in keys]
            await asyncio.sleep(0.1)
            tasks[1].cancel()  # its request went away while queued
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        assert isinstance(results[2], asyncio.CancelledError)
        assert [results[i].outcome for i in (0, 1, 3, 4)] == [Outcome.CLAIMED] * 4
        assert await key_row(db, tenant, keys[1]) is None  # never claimed for nobody
    finally:
        await store.close()


async def test_a_request_cancelled_while_its_claim_is_in_flight_frees_what_it_got(
    schema, db, tenant
):
    store = PostgresStore(schema, timeout=5)
    keys = [new_key() for _ in range(3)]
    try:
        await claim(store, tenant, new_key())
        async with db.acquire() as blocker, blocker.transaction():
            await blocker.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            store._batchers()["claim"]._lanes = 1
            store._batchers()["claim"]._hold = 0.05  # the three go as one
            tasks = [asyncio.create_task(claim(store, tenant, key)) for key in keys]
            await asyncio.sleep(0.3)  # sent, and waiting on the lock
            tasks[0].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert [r.outcome for r in results[1:]] == [Outcome.CLAIMED] * 2
        # The batch claimed the key for a request that had left: it is freed again.
        assert await eventually(lambda: _gone(db, tenant, keys[0]))
    finally:
        await store.close()


async def _gone(db: asyncpg.Pool, tenant: str, key: str) -> bool:
    return await key_row(db, tenant, key) is None
