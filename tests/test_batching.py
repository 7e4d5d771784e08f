"""Natural batching: under load the store's statements carry many requests' rows, and each
request keeps its own fate. Counted at the driver (asyncpg's query logger), on real
PostgreSQL, over HTTP where it matters."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from idempotency_asgi import PostgresStore, StoreRefused, migrate
from idempotency_asgi._postgres import sql
from idempotency_asgi._records import Outcome, StoredResponse
from tests import batching
from tests.apps import build_app
from tests.helpers import (
    client,
    effects,
    eventually,
    fresh_database,
    headers,
    key_row,
    new_key,
)
from tests.relay import Relay
from tests.test_store import QueryCounter

# These tests make their stores' batching what they test: not what the suite forces.
pytestmark = pytest.mark.skipif(
    bool(batching.mode()), reason=f"{batching.VARIABLE} is set: these set batching themselves"
)


def statements(counter: QueryCounter, text: str) -> int:
    return sum(text in query for query in counter.queries)


DONE = StoredResponse(201, [], b"{}")
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


async def test_batched_statements_planned_on_an_empty_key_table_never_scan_it(schema):
    """asyncpg prepares a statement once per connection, and the store's connections keep the
    generic plan made at its first run until a table's statistics change. Planned while the
    key table was empty, the batched completion once scanned the whole table on every run
    after it had grown (until autovacuum analysed it again: here it never does); and planned
    while the lease table was small and analysed, it read all of that table on every run
    once it had grown (a hashed EXISTS). Counted by PostgreSQL itself, with batches running
    on a key table of 20,000 rows and a lease table of 20,000: both tables' sequential
    scans, and the key table's index entries read (a plan that walked its whole primary key
    would read 20,000 a statement)."""
    async with fresh_database(schema) as dsn:
        await migrate(dsn)
        admin = await asyncpg.connect(dsn)
        try:
            for table in ("idempotency_keys", "idempotency_leases"):
                await admin.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            await admin.execute(
                "INSERT INTO idempotency_leases (tenant_id, idempotency_key, lease_token,"
                " lease_expires_at) SELECT 'other', 'l' || g, g, now() + interval '1 hour'"
                " FROM generate_series(1, 20) AS g"
            )
            await admin.execute("ANALYZE idempotency_leases")
            # One statement connection: every batch runs on it, each statement planned at
            # its first run.
            store = PostgresStore(dsn, statement_connections=1)
            tenant = "t-plans"
            try:

                async def rounds(count: int) -> None:
                    for _ in range(count):
                        claims = await asyncio.gather(
                            *(claim(store, tenant, new_key()) for _ in range(8))
                        )
                        assert all(c.lease is not None for c in claims)
                        done = await asyncio.gather(
                            *(store.complete(c.lease, DONE, ttl_seconds=60) for c in claims)
                        )
                        assert all(d is not None for d in done)

                await rounds(12)  # planned now, on a table of at most 96 rows
                await admin.execute(
                    "INSERT INTO idempotency_keys (tenant_id, idempotency_key, method, path,"
                    " fingerprint, state, lease_token, lease_expires_at, format_version,"
                    " expires_at) SELECT 'other', 'k' || g, 'POST', '/x', '\\x00', 'in_flight',"
                    " g, now() + interval '1 hour', 1, now() + interval '1 day'"
                    " FROM generate_series(1, 20000) AS g"
                )
                await admin.execute(
                    "INSERT INTO idempotency_leases (tenant_id, idempotency_key, lease_token,"
                    " lease_expires_at) SELECT 'other', 'm' || g, g, now() + interval '1 hour'"
                    " FROM generate_series(1, 20000) AS g"
                )
                before = await _sequential_scans(admin)
                entries = await _index_entries_read(admin)
                await rounds(6)
            finally:
                await store.close()  # its backends end, and report their counts
            await eventually(lambda: _alone(admin))  # its backends reported as they ended
            assert await _sequential_scans(admin) == before
            # 48 requests' claims and completions, a few entries each, in batches or alone.
            assert await _index_entries_read(admin) - entries < 2_000
            # Every claim and completion of the rounds went through.
            assert (
                await admin.fetchval(
                    "SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1"
                    " AND state = 'completed'",
                    tenant,
                )
                == 18 * 8
            )
        finally:
            await admin.close()


async def _sequential_scans(conn: asyncpg.Connection) -> dict[str, int]:
    """The key table's and the lease table's."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await conn.fetch(
        "SELECT relname, seq_scan FROM pg_stat_user_tables"
        " WHERE relname IN ('idempotency_keys', 'idempotency_leases')"
    )
    return {row["relname"]: row["seq_scan"] for row in rows}


async def _index_entries_read(conn: asyncpg.Connection) -> int:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return await conn.fetchval(
        "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = 'idempotency_keys'"
    )


async def test_the_store_s_own_connections_plan_a_batched_statement_once(schema, tenant):
    """A batch's arrays are shorter than the generic plan assumes, so PostgreSQL kept
    planning the batched statements anew on every run (50 to 70 µs of its CPU a request under
    load): the store's own connections ask for the generic plan, made once. Counted by
    PostgreSQL itself, on the store's one statement connection."""
    store = PostgresStore(schema, statement_connections=1)
    try:
        keys = [new_key() for _ in range(3)]
        arrays = ([tenant] * 3, keys, [b"\x00"] * 3, [1, 2, 3], [4, 5, 6])
        for _ in range(8):
            assert len(await store._db.call("fetch", sql.PEEK_MANY, *arrays)) == 3
        plans = await store._db.call(
            "fetchrow",
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            sql.PEEK_MANY,
        )
    finally:
        await store.close()
    assert (plans["generic_plans"], plans["custom_plans"]) == (8, 0)


async def _alone(conn: asyncpg.Connection) -> bool:
    return await conn.fetchval(
        "SELECT count(*) = 0 FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )


@pytest.mark.parametrize(
    ("setting", "as_unknown"),
    [("enable_seqscan", False), ("plan_cache_mode", False), ("plan_cache_mode", True)],
    ids=["pooler-enable_seqscan", "pooler-plan_cache_mode", "server-plan_cache_mode"],
)
async def test_a_pooler_that_refuses_the_store_s_settings_still_gets_its_connections(
    schema, tenant, setting, as_unknown
):
    """PgBouncer refuses a startup parameter it does not know (`enable_seqscan` or
    `plan_cache_mode`, which the store's own connections ask for) with an error and a close,
    and so does a PostgreSQL older than a setting (`plan_cache_mode` came in 12): the store
    then connects without them, once, and from then on, and every statement works."""
    async with Relay(schema, refuse={setting}, as_unknown=as_unknown) as relay:
        store = PostgresStore(relay.dsn)
        try:
            # Only what was refused is left out: the store's connections have the rest.
            kept = await store._db.call("fetchrow", "SHOW enable_seqscan")
            planned = await store._db.call("fetchrow", "SHOW plan_cache_mode")
            if setting == "enable_seqscan":
                assert (kept[0], planned[0]) == ("on", "force_generic_plan")
            else:
                assert (kept[0], planned[0]) == ("off", "auto")
            key = new_key()
            claimed = await claim(store, tenant, key)
            assert claimed.lease is not None
            assert await store.complete(claimed.lease, DONE, ttl_seconds=60)
            replay = await claim(store, tenant, key)
            assert replay.outcome is Outcome.COMPLETED
            more = await asyncio.gather(*(claim(store, tenant, new_key()) for _ in range(8)))
            assert all(c.lease is not None for c in more)
        finally:
            await store.close()
    assert relay.refused == 1
