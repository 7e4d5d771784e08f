"""PostgresStore on its own: claims, leases, fencing, takeover, and what each costs."""

from __future__ import annotations

import asyncio
import hashlib

import asyncpg
import pytest

from idempotency_asgi import PostgresStore, StoreUnavailable, migrate
from idempotency_asgi._records import Outcome, StoredResponse
from tests import modes
from tests.apps import build_app
from tests.helpers import (
    client,
    effects,
    fresh_database,
    headers,
    key_row,
    new_key,
    running,
)

FP = hashlib.sha256(b"request").digest()
OTHER_FP = hashlib.sha256(b"other request").digest()
RESPONSE = StoredResponse(
    status=201, headers=[(b"content-type", b"application/json")], body=b'{"ok":true}'
)


@pytest.fixture
async def store(schema):
    store = PostgresStore(schema)
    yield store
    await store.close()


def claim(store, tenant, key, fp=FP, lease=5.0, ttl=60.0):
    return store.claim(
        tenant=tenant,
        key=key,
        method="POST",
        path="/p",
        fingerprint=fp,
        lease_seconds=lease,
        ttl_seconds=ttl,
    )


async def test_claim_outcomes(store, tenant):
    key = new_key()
    first = await claim(store, tenant, key)
    assert first.outcome is Outcome.CLAIMED and first.lease is not None
    busy = await claim(store, tenant, key)
    assert busy.outcome is Outcome.IN_FLIGHT and 4 < busy.lease_remaining <= 5
    assert (await claim(store, tenant, key, fp=OTHER_FP)).outcome is Outcome.MISMATCH
    assert await store.complete(first.lease, RESPONSE, ttl_seconds=60)
    done = await claim(store, tenant, key)
    assert done.outcome is Outcome.COMPLETED and done.response == RESPONSE
    assert (await claim(store, tenant, key, fp=OTHER_FP)).outcome is Outcome.MISMATCH


async def test_takeover_after_the_lease_lapses_fences_out_the_stale_owner(store, db, tenant):
    key = new_key()
    stale = (await claim(store, tenant, key, lease=0.2)).lease
    await asyncio.sleep(0.3)  # the owner "died": nobody renewed its lease
    taken = await claim(store, tenant, key)
    assert taken.outcome is Outcome.TAKEN_OVER
    assert taken.lease.token != stale.token
    # The stale owner wakes up: it can neither renew, nor complete, nor release the key.
    assert not await store.renew(stale)
    assert not await store.complete(stale, StoredResponse(200, [], b"stale"), ttl_seconds=60)
    await store.release(stale)
    assert (await key_row(db, tenant, key))["lease_token"] == taken.lease.token
    assert await store.complete(taken.lease, RESPONSE, ttl_seconds=60)
    assert (await claim(store, tenant, key)).response == RESPONSE


async def test_a_lapsed_lease_is_taken_over_by_exactly_one_of_many(store, tenant):
    key = new_key()
    await claim(store, tenant, key, lease=0.1)
    await asyncio.sleep(0.2)
    results = await asyncio.gather(*(claim(store, tenant, key) for _ in range(20)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.TAKEN_OVER) == 1
    assert outcomes.count(Outcome.IN_FLIGHT) == 19


async def test_a_lapsed_lease_is_not_taken_by_a_different_request(store, tenant):
    key = new_key()
    await claim(store, tenant, key, lease=0.1)
    await asyncio.sleep(0.2)
    assert (await claim(store, tenant, key, fp=OTHER_FP)).outcome is Outcome.MISMATCH


async def test_release_frees_the_key_only_for_its_holder(store, db, tenant):
    key = new_key()
    lease = (await claim(store, tenant, key)).lease
    await store.release(lease)
    assert await key_row(db, tenant, key) is None
    again = (await claim(store, tenant, key)).lease
    await store.release(lease)  # a stale release of an earlier holder does nothing
    assert (await key_row(db, tenant, key))["lease_token"] == again.token


async def test_completed_rows_cannot_be_released(store, db, tenant):
    key = new_key()
    lease = (await claim(store, tenant, key)).lease
    await store.complete(lease, RESPONSE, ttl_seconds=60)
    await store.release(lease)
    assert (await key_row(db, tenant, key))["state"] == "completed"


async def test_bodies_are_stored_byte_for_byte(store, tenant):
    key = new_key()
    body = b'{"b":1,  "a":2}\x00\xff' + bytes(range(256))
    response = StoredResponse(201, [(b"x-bin", bytes(range(32, 256)))], body)
    lease = (await claim(store, tenant, key)).lease
    await store.complete(lease, response, ttl_seconds=60)
    assert (await claim(store, tenant, key)).response == response


async def test_sixty_concurrent_claims_of_one_new_key_reserve_it_once(store, tenant):
    key = new_key()
    results = await asyncio.gather(*(claim(store, tenant, key) for _ in range(60)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.CLAIMED) == 1
    assert outcomes.count(Outcome.IN_FLIGHT) == 59


async def test_heartbeat_keeps_a_slow_live_request_from_being_taken_over(schema, db, tenant):
    # Lease of 1 s, request of 3 s: only renewals keep the duplicate out.
    app = build_app(schema, lease_seconds=1.0)
    key = new_key()
    async with client(app) as http:
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="3000"))
        )
        await asyncio.sleep(2.2)
        duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        first = await slow
    assert duplicate.status_code == 409
    assert first.status_code == 201
    assert await effects(db, tenant, key) == 1


@modes.two_phase
async def test_stale_transactional_owner_rolls_back_and_is_told(schema, db, tenant):
    # The owner is alive but its lease lapsed (a pause longer than the lease, as a GC stall
    # or a frozen VM would cause); a retry takes the key over and completes. The stale owner's
    # fenced completion then hits no row: its business write rolls back and it answers 409.
    app = build_app(schema, lease_seconds=30)
    key = new_key()
    async with client(app) as http:
        stale = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1000"))
        )
        await running(db, tenant, key)
        await db.execute(
            "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'"
            " WHERE tenant_id = $1 AND idempotency_key = $2",
            tenant,
            key,
        )
        winner = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        loser = await stale
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert winner.status_code == 201
    assert loser.status_code == 409 and loser.json()["type"].endswith(":lease-lost")
    assert replay.content == winner.content
    assert await effects(db, tenant, key) == 1
    survivor = await db.fetchval(
        "SELECT id FROM effects WHERE tenant = $1 AND idempotency_key = $2", tenant, key
    )
    assert survivor == winner.json()["effect_id"]


class QueryCounter:
    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, record) -> None:
        self.queries.append(record.query)

    async def count(self) -> int:
        # asyncpg calls query loggers with loop.call_soon: let them run first.
        await asyncio.sleep(0.05)
        return len(self.queries)

    async def init(self, conn) -> None:
        conn.add_query_logger(self)


async def test_replay_conflict_and_mismatch_each_cost_one_statement(schema, tenant):
    """Counted at the driver: every statement the store's connections run is logged.

    With asyncpg's statement cache a repeated statement is one Bind/Execute/Sync exchange,
    i.e. one network round trip; the pool's per-release reset query is skipped for the
    store's own connections, so nothing else is sent.
    """
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    app = build_app(schema, store=store)
    key, slow_key = new_key(), new_key()
    try:
        async with client(app) as http:
            # warm the statement cache
            await http.post("/plain/charge", json={}, headers=headers(tenant, "warm"))
            await http.post("/plain/charge", json={}, headers=headers(tenant, "warm"))
            await counter.count()

            counter.queries.clear()
            await http.post("/plain/charge", json={}, headers=headers(tenant, key))
            new_cost = await counter.count()

            counter.queries.clear()
            replay = await http.post("/plain/charge", json={}, headers=headers(tenant, key))
            replay_cost = await counter.count()

            counter.queries.clear()
            mismatch = await http.post("/plain/charge", json={"x": 1}, headers=headers(tenant, key))
            mismatch_cost = await counter.count()

            slow = asyncio.create_task(
                http.post(
                    "/plain/charge", json={}, headers=headers(tenant, slow_key, x_delay_ms="500")
                )
            )
            await asyncio.sleep(0.2)
            counter.queries.clear()
            conflict = await http.post("/plain/charge", json={}, headers=headers(tenant, slow_key))
            conflict_cost = await counter.count()
            await slow
    finally:
        await store.close()
    assert replay.headers["idempotent-replayed"] == "true"
    assert mismatch.status_code == 422 and conflict.status_code == 409
    assert (replay_cost, conflict_cost, mismatch_cost) == (1, 1, 1)
    # A new key: the claim and the completion (the handler's own writes go through its pool).
    assert new_cost == 2


async def test_statement_connections_queue_fail_closed_and_recover(schema, db, tenant):
    store = PostgresStore(schema, statement_connections=1, timeout=0.3)
    try:
        await store.stats()  # opens the one statement connection
        statements = store._db._statements
        held = await statements.acquire(1.0)
        # The only connection is taken: the next call waits its timeout, then fails closed.
        with pytest.raises(StoreUnavailable):
            await store.inspect(tenant=tenant, key="k")
        waiting = asyncio.create_task(store.inspect(tenant=tenant, key="k"))
        await asyncio.sleep(0.05)
        statements.release(held)  # handed straight to the waiter
        assert await waiting is None
        # The server ends the connection. A connection seen closed is never handed out; one
        # whose end is not noticed yet fails its call (fail closed) and is dropped.
        pid = await store._db.call("fetchval", "SELECT pg_backend_pid()")
        await db.execute("SELECT pg_terminate_backend($1)", pid)
        try:
            new_pid = await store._db.call("fetchval", "SELECT pg_backend_pid()")
        except StoreUnavailable:
            new_pid = await store._db.call("fetchval", "SELECT pg_backend_pid()")
        assert new_pid != pid
    finally:
        await store.close()


async def test_statements_about_one_key_probe_the_primary_key_whatever_the_statistics(schema):
    """A generic plan (what a prepared statement settles on) must never walk the tenant's
    in-flight index: with many keys in flight for one tenant (here, a table fresh enough
    that the planner believes that index tiny), a completion, release or renewal that did
    scanned every in-flight entry of the tenant, dead ones included."""
    from idempotency_asgi._postgres import sql
    from idempotency_asgi._postgres.sql.literals import literal

    async with fresh_database(schema) as url:
        await migrate(url)
        store = PostgresStore(url)
        try:
            leases = [(await claim(store, "t", f"k{n}")).lease for n in range(1500)]
            for lease in leases[:1000]:
                await store.complete(lease, RESPONSE, ttl_seconds=60)
        finally:
            await store.close()
        token = leases[-1].token
        calls = {
            "COMPLETE": ("t", "k1499", token, 1, 201, b"[]", b"{}", 60.0),
            "RELEASE": ("t", "k1499", token),
            "RENEW": ("t", "k1499", token, 5.0),
            "MARK_WAITING": ("t", "k1499"),
            "TAKE_OVER": ("t", "k1499", "POST", "/p", FP, 1, 5.0, 60.0, 1, token, 7, 8),
            "CLAIM": ("t", "k1499", "POST", "/p", FP, 1, 5.0, 60.0, 1, 7, 8),
            "PEEK": ("t", "k1499", FP, 7, 8),
        }
        conn = await asyncpg.connect(url)

        def value(arg: object) -> str:
            if isinstance(arg, float):
                return repr(arg)
            if isinstance(arg, tuple):  # a ctid
                return f"'({int(arg[0])},{int(arg[1])})'"
            return literal(arg)

        async def generic_plan(statement: str, args: tuple[object, ...]) -> str:
            # Prepared in SQL and shown by EXPLAIN EXECUTE: the plan the statement keeps (an
            # EXPLAIN prepared with its arguments is planned with their values instead).
            name = f"probe_{abs(hash(statement))}"
            await conn.execute(f"PREPARE {name} AS {statement}")
            values = ", ".join(map(value, args))
            rows = await conn.fetch(f"EXPLAIN (COSTS OFF) EXECUTE {name}({values})")
            return "\n".join(row[0] for row in rows)

        try:
            await conn.execute("SET plan_cache_mode = force_generic_plan")
            for name, args in calls.items():
                plan = await generic_plan(getattr(sql, name), args)
                assert "idempotency_keys_in_flight_idx" not in plan, (name, plan)
                assert "idempotency_keys_pkey" in plan, (name, plan)
            # The completion inside a handler's transaction reaches its row by its ctid, and
            # reads nothing else of the table (see sql.COMPLETE_BY_ROW).
            args = (*calls["COMPLETE"], leases[-1].row)
            plan = await generic_plan(sql.COMPLETE_BY_ROW, args)
            assert "Tid Scan on idempotency_keys" in plan, plan
            assert "idempotency_keys_pkey" not in plan and "in_flight_idx" not in plan, plan
        finally:
            await conn.close()
