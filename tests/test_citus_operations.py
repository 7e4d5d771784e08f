"""Operating on a Citus cluster: the reaper and the sweeper (library and CLI), the store's
batching (off where the key table is distributed; a batched statement across tenants is
still correct there), `verify` against the example payments API with its tables in their
Citus form, and the gateway. Real cluster, real processes, the database audited."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from idempotency_asgi import IdempotentConsumer, PostgresStore
from idempotency_asgi._postgres import sql
from idempotency_asgi._postgres.keyhash import key_lock, request_lock
from idempotency_asgi._records import Outcome
from idempotency_asgi.maintenance import Reaper, Sweeper
from idempotency_asgi.verify import verify
from tests.apps import build_app
from tests.citus_cluster import tenants_on, worker_of
from tests.gateway_support import GatewayProcess, NodeUpstream
from tests.helpers import client, effects, headers, new_key
from tests.server import ROOT, UvicornProcess
from tests.test_maintenance import DONE, FP, add, claim, cli
from tests.test_verify import PROPERTIES, keys_answered, payments_target, statuses

pytestmark = pytest.mark.citus


@pytest.fixture(scope="module")
async def cdb(citus: Any) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(citus.coordinator, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture
async def store(citus: Any) -> AsyncIterator[PostgresStore]:
    made = PostgresStore(citus.coordinator)
    await made.open()
    yield made
    await made.close()


async def spread_tenants(db: asyncpg.Pool, citus: Any, per_worker: int) -> list[str]:
    """New tenants, `per_worker` on each worker."""
    prefix = f"ops-{uuid.uuid4().hex[:6]}"
    found: list[str] = []
    for port in (citus.port + 1, citus.port + 2):
        found += await tenants_on(db, port, per_worker, prefix)
    return found


async def keys_of(db: asyncpg.Pool, tenants: list[str]) -> set[tuple[str, str]]:
    rows = await db.fetch(
        "SELECT tenant_id, idempotency_key FROM idempotency_keys WHERE tenant_id = ANY($1)",
        tenants,
    )
    return {(row["tenant_id"], row["idempotency_key"]) for row in rows}


# -- the reaper and the sweeper ---------------------------------------------------------------


async def test_the_reaper_and_the_sweeper_work_tenant_by_tenant_in_bounded_batches(
    citus, cdb, store
):
    assert store._db.distributed
    tenants = await spread_tenants(cdb, citus, 3)
    for tenant in tenants:
        await add(store, "expired", tenant=tenant)
        await add(store, "fresh", tenant=tenant)
        await add(store, "dead", tenant=tenant, completed=False)
        await add(store, "live", tenant=tenant, completed=False)
    await cdb.execute(
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
        " WHERE tenant_id = ANY($1) AND idempotency_key = 'expired'",
        tenants,
    )
    await cdb.execute(
        "UPDATE idempotency_keys SET lease_expires_at = now() - interval '600 seconds'"
        " WHERE tenant_id = ANY($1) AND idempotency_key = 'dead'",
        tenants,
    )
    # Bounded: at most batch_size rows a run, over every tenant that has some.
    reaper = Reaper(store, batch_size=4)
    reaped = [await reaper.run_once() for _ in range(3)]
    assert all(n <= 4 for n in reaped) and sum(reaped) >= len(tenants)
    swept = await Sweeper(store, grace_seconds=300, batch_size=100).run_once()
    assert swept >= len(tenants)
    left = await keys_of(cdb, tenants)
    assert left == {(t, k) for t in tenants for k in ("fresh", "live")}
    # A swept key is free again; a reaped one too.
    for tenant in tenants[:2]:
        await add(store, "dead", tenant=tenant)
        await add(store, "expired", tenant=tenant)


async def test_the_cli_reaps_sweeps_inspects_and_counts_on_the_cluster(citus, cdb, store):
    tenants = await spread_tenants(cdb, citus, 1)
    for tenant in tenants:
        await add(store, "expired", tenant=tenant)
        await add(store, "dead", tenant=tenant, completed=False)
        await add(store, "kept", tenant=tenant)
    await cdb.execute(
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
        " WHERE tenant_id = ANY($1) AND idempotency_key = 'expired'",
        tenants,
    )
    await cdb.execute(
        "UPDATE idempotency_keys SET lease_expires_at = now() - interval '900 seconds'"
        " WHERE tenant_id = ANY($1) AND idempotency_key = 'dead'",
        tenants,
    )
    shown = cli("inspect", "--tenant", tenants[0], "kept", url=citus.coordinator)
    assert shown.returncode == 0, shown.stderr
    assert "state             completed" in shown.stdout
    stats = cli("stats", url=citus.coordinator)
    assert stats.returncode == 0, stats.stderr
    size = int(next(x for x in stats.stdout.splitlines() if x.startswith("table_bytes")).split()[1])
    shell = await cdb.fetchval("SELECT pg_total_relation_size('idempotency_keys')")
    assert size > shell  # the shards', not the coordinator's empty table
    reaped = cli("reap", "--once", "--batch-size", "1000", url=citus.coordinator)
    assert reaped.returncode == 0, reaped.stderr
    assert int(reaped.stdout.split()[-1]) >= 2
    swept = cli("sweep", "--once", "--grace", "600", url=citus.coordinator)
    assert swept.returncode == 0, swept.stderr
    assert int(swept.stdout.split()[-1]) >= 2
    assert await keys_of(cdb, tenants) == {(t, "kept") for t in tenants}


async def test_the_reaper_deletes_old_consumer_records_over_every_shard(citus, cdb, store):
    consumer = f"c-{uuid.uuid4().hex[:6]}"
    await cdb.execute(
        "INSERT INTO idempotency_processed_messages (consumer, message_id, processed_at)"
        " SELECT $1, 'old-' || n, now() - interval '2 days' FROM generate_series(1, 20) AS n",
        consumer,
    )
    await cdb.execute(
        "INSERT INTO idempotency_processed_messages (consumer, message_id) VALUES ($1, 'new')",
        consumer,
    )
    reaper = Reaper(store, batch_size=1000, processed_retention_seconds=86400)
    await reaper.run_once()
    left = await cdb.fetch(
        "SELECT message_id FROM idempotency_processed_messages WHERE consumer = $1", consumer
    )
    assert [row["message_id"] for row in left] == ["new"]


# -- batching ---------------------------------------------------------------------------------


async def test_the_store_shares_no_statement_across_requests_on_the_cluster(citus, cdb):
    """Batching is on by default; on the cluster the store sees the key table distributed
    and runs every request's own routed statements (a batch would span shards)."""
    store = PostgresStore(citus.coordinator)
    app = build_app(citus.coordinator, store=store)
    tenants = await spread_tenants(cdb, citus, 5)
    keys = {tenant: [new_key() for _ in range(4)] for tenant in tenants}
    async with client(app) as http:
        assert store._db.distributed
        answers = await asyncio.gather(
            *(
                http.post("/tx/charge", json={}, headers=headers(tenant, key))
                for tenant in tenants
                for key in keys[tenant]
                for _ in range(2)  # each key twice at once: one runs, one 409s or replays
            )
        )
    assert {a.status_code for a in answers} <= {201, 409}
    assert all(n == (0, 0) for n in store.batching().values()), store.batching()
    for tenant in tenants:
        for key in keys[tenant]:
            assert await effects(cdb, tenant, key) == 1


@pytest.mark.parametrize(
    "name", ["CLAIM_MANY", "PEEK_MANY", "COMPLETE_MANY", "RELEASE_MANY", "RENEW_MANY"]
)
async def test_citus_refuses_every_batched_statement(citus, cdb, name):
    """Why the store batches nothing there: Citus will not run a statement that looks each
    row up through a LATERAL subquery with LIMIT 1 over several shards."""
    statement = await cdb.acquire()
    try:
        prepared = await statement.prepare(getattr(sql, name))
        values = {"text": ["t"], "bytea": [b"x"], "int8": [1], "float8": [1.0], "int2": [201]}
        args = [
            values[p.name.removesuffix("[]")] if p.kind == "array" else 1
            for p in prepared.get_parameters()
        ]
        with pytest.raises(asyncpg.FeatureNotSupportedError, match="cannot push down"):
            await prepared.fetch(*args)
    finally:
        await cdb.release(statement)


async def test_a_store_batching_on_the_cluster_still_answers_every_row_right(citus, cdb):
    """A store that batches there anyway (as one that did not know the table distributed),
    rows of tenants on both workers in each batch: Citus refuses each batch, and the store
    runs each row's own statement instead, as it does for any refused batch. Every answer
    is still the right one; each batch cost a refused round trip first."""
    store = PostgresStore(citus.coordinator)
    await store.open()
    store._db.distributed = False  # as a store that did not know
    store._db.arrays_always = True
    try:
        tenants = await spread_tenants(cdb, citus, 4)
        pairs = [(tenant, f"b-{n}") for tenant in tenants for n in range(3)]
        claims = await asyncio.gather(*(claim(store, k, tenant=t, ttl=60.0) for t, k in pairs))
        assert [c.outcome for c in claims] == [Outcome.CLAIMED] * len(pairs)
        assert all(await asyncio.gather(*(store.renew(c.lease) for c in claims)))
        done = await asyncio.gather(
            *(store.complete(c.lease, DONE, ttl_seconds=60.0) for c in claims[::2])
        )
        assert all(done)
        await asyncio.gather(*(store.release(c.lease) for c in claims[1::2]))
        again = await asyncio.gather(*(claim(store, k, tenant=t, ttl=60.0) for t, k in pairs))
        expected = [Outcome.COMPLETED if n % 2 == 0 else Outcome.CLAIMED for n in range(len(pairs))]
        assert [c.outcome for c in again] == expected
        assert sum(n for n, _ in store.batching().values()) > 0  # batches were tried
    finally:
        await store.close()


# -- verify, the example, the gateway -------------------------------------------------------


@pytest.fixture(scope="module")
def payments_on_citus(citus: Any) -> Any:
    """The example payments API with its tables in their Citus form (the SQL the docs
    show), served against the coordinator."""
    citus.psql(0, (ROOT / "examples" / "payments" / "citus.sql").read_text())
    env = {"DATABASE_URL": citus.coordinator, "PAYMENTS_FAULT_INJECTION": "1"}
    server = UvicornProcess("examples.payments.app:app", env).start(ready_path="/healthz")
    yield server
    server.stop()


async def test_the_example_tables_are_distributed_with_the_keys(citus, payments_on_citus):
    groups = citus.psql(
        0,
        "SELECT string_agg(DISTINCT colocationid::text, ',') FROM pg_dist_partition"
        " WHERE logicalrelid::text IN ('payments', 'outbox', 'idempotency_keys',"
        " 'idempotency_leases')",
    )
    assert groups.isdigit()  # one group


@pytest.mark.slow
async def test_verify_passes_against_the_example_on_the_cluster(payments_on_citus, cdb):
    report = await verify(payments_target(payments_on_citus))
    assert statuses(report) == dict.fromkeys(PROPERTIES, "passed"), report.text()
    for tenant, other in (("acme", False), ("globex", True)):
        keys = keys_answered(report, other=other)
        rows = await cdb.fetch(
            "SELECT idempotency_key, count(*) AS n FROM payments"
            " WHERE tenant_id = $1 AND idempotency_key = ANY($2::text[])"
            " GROUP BY idempotency_key",
            tenant,
            sorted(keys),
        )
        assert {row["idempotency_key"]: row["n"] for row in rows} == dict.fromkeys(keys, 1)


async def test_the_gateway_on_the_cluster(citus):
    node = NodeUpstream().start()
    gateway = GatewayProcess(node.url, citus.coordinator, "--tenant-from", "authorization")
    try:
        gateway.start(timeout=60)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            keys = [new_key() for _ in range(4)]
            for key in keys:
                first = await http.post(
                    "/orders",
                    json={"sku": "C"},
                    headers={"authorization": "Bearer citus", **headers(None, key)},
                )
                again = await http.post(
                    "/orders",
                    json={"sku": "C"},
                    headers={"authorization": "Bearer citus", **headers(None, key)},
                )
                assert first.status_code == 201, first.text
                assert again.headers["idempotent-replayed"] == "true"
                assert again.content == first.content
            storm_key = new_key()
            storm = await asyncio.gather(
                *(
                    http.post(
                        "/orders",
                        json={"sku": "S"},
                        headers={"authorization": "Bearer citus", **headers(None, storm_key)},
                    )
                    for _ in range(20)
                )
            )
        assert {a.status_code for a in storm} <= {201, 409}
        assert all(node.created(key) == 1 for key in [*keys, storm_key])
    finally:
        gateway.stop()
        node.stop()


async def test_the_sweeper_on_the_cluster_is_not_starved_by_renewed_requests(store, cdb):
    """Tenants whose only old keys are renewed (long requests, still running) have nothing to
    sweep: they must not fill the run's list of tenants with work, or a stale key of another
    tenant is never swept."""
    prefix = uuid.uuid4().hex[:6]
    running = [f"long-{prefix}-{n}" for n in range(12)]
    stale = f"stale-{prefix}"
    leases = [await add(store, "k", tenant=tenant, completed=False) for tenant in running]
    await add(store, "k", tenant=stale, completed=False)
    # Two days stale, swept with a grace of one: no other test's key (minutes old at most,
    # on the same cluster) is stale enough to take a place in the run.
    await cdb.execute(
        "UPDATE idempotency_keys SET lease_expires_at = now() - interval '2 days'"
        " WHERE tenant_id = ANY($1::text[])",
        [*running, stale],
    )
    assert all([await store.renew(lease) for lease in leases])
    swept = await store.sweep(batch_size=2, grace_seconds=86400)
    assert [(row["tenant_id"], row["idempotency_key"]) for row in swept] == [(stale, "k")]
    assert await cdb.fetchval(
        "SELECT count(*) FROM idempotency_keys WHERE tenant_id = ANY($1::text[])", running
    ) == len(running)


async def test_a_store_made_from_a_pool_learns_it_on_its_first_claim(citus, cdb):
    """A store given the application's pool, never opened (no lifespan): its first claim
    reads whether the key table is distributed, and takes the routed path."""
    pool = await asyncpg.create_pool(citus.coordinator, min_size=1, max_size=2)
    store = PostgresStore(pool)
    try:
        tenant = f"pool-{uuid.uuid4().hex[:8]}"
        lease = await add(store, "k", tenant=tenant)
        assert store._db.distributed and lease is not None
        assert (await store.inspect(tenant=tenant, key="k"))["state"] == "completed"
    finally:
        await store.close()
        await pool.close()


async def test_an_atomic_store_made_from_a_pool_learns_it_on_its_first_request(citus, cdb):
    """The same for the atomic mode with batching off: its first look must not skip the
    reading, or its lock is taken on the coordinator while the claims look on the worker,
    and its record is a statement Citus refuses."""
    pool = await asyncpg.create_pool(citus.coordinator, min_size=1, max_size=4)
    store = PostgresStore(pool, batch=False)
    app = build_app(citus.coordinator, store=store, atomic=True)
    tenant, key = f"apool-{uuid.uuid4().hex[:8]}", new_key()
    try:
        # No lifespan: nothing opens the store before its first request.
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            again = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        assert store._db.distributed
        assert first.status_code == 201 and again.content == first.content
        assert again.headers["idempotent-replayed"] == "true"
        assert await effects(cdb, tenant, key) == 1
    finally:
        await store.close()
        await pool.close()


async def test_the_atomic_lock_on_the_cluster_is_the_request_s_first(citus, cdb):
    """LOCK_KEY tries the request's lock before the key's, as on one server: whoever finds
    the key's lock held then finds the request's held too when it is the same request (409),
    never free (which says another request holds the key: 422). Here the request's lock is
    held (shared, as a look holds it for a moment) on the tenant's worker: the atomic
    transaction must give up at once, holding neither, not hold the key's lock while it
    waits for the request's."""
    tenant = (await spread_tenants(cdb, citus, 1))[0]
    key = new_key()
    locks = {"key": key_lock(tenant, key), "request": request_lock(tenant, key, FP)}
    worker = await asyncpg.connect(citus.url(await worker_of(cdb, tenant) - citus.port))
    try:
        await worker.execute("SELECT pg_advisory_lock_shared($1)", locks["request"])
        conn = await asyncpg.connect(citus.coordinator)
        try:
            async with conn.transaction():
                got = await asyncio.wait_for(
                    conn.fetchval(sql.LOCK_KEY, tenant, key, locks["key"], locks["request"]),
                    timeout=5,
                )
                assert got is None  # not had
                # ...and the key's lock is free: nobody holds what it did not have.
                assert await worker.fetchval("SELECT pg_try_advisory_lock($1)", locks["key"])
                await worker.execute("SELECT pg_advisory_unlock($1)", locks["key"])
        finally:
            await conn.close()
    finally:
        await worker.close()


async def test_the_idempotent_consumer_on_the_cluster(citus, cdb):
    """The consumer's record (distributed by message id) and its handler's write (a tenant
    table) commit together: a transaction over two shards, which Citus commits in two
    phases. Redeliveries, concurrent ones included, never run the handler again."""
    tenant, message = f"c-{uuid.uuid4().hex[:8]}", f"m-{uuid.uuid4().hex[:8]}"
    pool = await asyncpg.create_pool(citus.coordinator, min_size=1, max_size=8)
    consumer = IdempotentConsumer(pool, name="provider")

    async def handler(conn: Any) -> bytes:
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, 'consumer')",
            tenant,
            message,
        )
        await asyncio.sleep(0.2)
        return b"done"

    try:
        results = await asyncio.gather(*(consumer.process(message, handler) for _ in range(5)))
        again = await consumer.process(message, handler)
    finally:
        await pool.close()
    assert sum(r.first for r in results) == 1
    assert {r.result for r in results} == {b"done"} and not again.first
    assert await effects(cdb, tenant, message) == 1
