"""The atomic mode: the key's claim, the handler's writes and the record in one transaction,
one COMMIT; the transaction is the lease. Real PostgreSQL, real uvicorn processes where the
wire and crashes matter, and the database audited afterwards."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from typing import Any

import asyncpg
import httpx
import pytest

from examples.local_postgres import LocalPostgres
from idempotency_asgi import PostgresStore, migrate
from idempotency_asgi._postgres.atomic import AtomicRun
from idempotency_asgi._postgres.onecommit import ShortRun
from idempotency_asgi._records import StoredResponse
from tests import server
from tests.apps import EFFECTS_DDL, MODES, app_in_mode, build_app
from tests.helpers import (
    assert_problem,
    claimed,
    client,
    effects,
    eventually,
    headers,
    key_locked,
    key_row,
    new_key,
    running,
    sessions,
)
from tests.server import wire
from tests.test_store import QueryCounter


def serve(
    schema: str,
    *,
    atomic: bool = True,
    store: dict | None = None,
    lease_seconds: float = 10,
    **options,
):
    return server.serve(
        schema,
        store=store,
        options={"atomic": atomic, **options},
        IDEMPOTENCY_LEASE_SECONDS=str(lease_seconds),
    )


async def next_xid(db: asyncpg.Pool) -> int:
    """The next transaction id, read without taking one."""
    return int(await db.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text"))


# -- the contract, in one transaction --------------------------------------------------------


async def test_a_new_key_is_one_write_transaction(schema, db, tenant):
    app = build_app(schema, atomic=True)
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))  # warm
        before = await next_xid(db)
        answers = [
            await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
            for _ in range(10)
        ]
        after = await next_xid(db)
    assert [a.status_code for a in answers] == [201] * 10
    # The claim, the handler's write and the record: one transaction, one COMMIT, each.
    assert after - before == 10


async def test_what_each_answer_costs_the_store(schema, tenant):
    """Counted at the driver: every statement sent on the store's connections, the handler's
    own INSERT included. A new key: the claim with its BEGIN, the handler's statement, the
    record with its COMMIT (two round trips of the store's). A duplicate of a request this
    process runs: nothing, told from memory. While most keys claimed lately were new, a key
    that is not costs the claim and its ROLLBACK (a replay, a read of its record between);
    once most are found taken (retries of finished keys), one look does."""
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    app = build_app(schema, store=store, atomic=True)
    key, slow_key = new_key(), new_key()

    async def cost(body: dict, key: str) -> tuple[int, list[str]]:
        await counter.count()
        counter.queries.clear()
        response = await http.post("/tx/charge", json=body, headers=headers(tenant, key))
        await counter.count()
        return response.status_code, list(counter.queries)

    try:
        async with client(app) as http:
            for _ in range(3):  # warm the statement caches
                await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
            status, new = await cost({}, key)
            assert status == 201 and len(new) == 3, new
            claim, handler, record = new
            assert claim.startswith("BEGIN; SELECT FROM generate_series(1, ")
            assert "idempotency_asgi_claim(" in claim
            assert "INSERT INTO effects" in handler
            assert "idempotency_asgi_record(" in record
            assert "; COMMIT; SELECT pg_advisory_unlock(" in record
            replay = await cost({}, key)
            mismatch = await cost({"x": 1}, key)
            slow = asyncio.create_task(
                http.post(
                    "/tx/charge", json={}, headers=headers(tenant, slow_key, x_delay_ms="500")
                )
            )
            await asyncio.sleep(0.2)
            conflict = await cost({}, slow_key)
            await slow
            for _ in range(40):  # retries of a finished key, and nothing else
                await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            looked = await cost({}, key)
            looked_mismatch = await cost({"x": 1}, key)
    finally:
        await store.close()
    assert replay[0] == 201 and [q.split(None, 1)[0] for q in replay[1]] == [
        "BEGIN;",
        "SELECT",  # the record read, to replay it
        "ROLLBACK",
    ], replay
    assert mismatch[0] == 422 and len(mismatch[1]) == 2, mismatch
    assert conflict == (409, [])
    assert looked[0] == 201 and len(looked[1]) == 1, looked
    assert "pg_try_advisory_xact_lock_shared" in looked[1][0]
    assert looked_mismatch[0] == 422 and len(looked_mismatch[1]) == 1, looked_mismatch


async def test_the_key_is_read_in_its_own_statement_after_the_lock_is_held(schema, db):
    """A statement reads the snapshot taken when it began. One that tries the lock and reads
    the key's row together can begin before an earlier owner commits, take the lock that
    owner then lets go of, and miss its record: the key would run twice. So the claim
    function takes the locks first, each in a statement of its own, and then reads the row
    in another, and it is VOLATILE (a STABLE function's statements read the snapshot of the
    query that called it). This fails if the two are ever "optimised" into one."""
    source, volatility = await db.fetchrow(
        "SELECT prosrc, provolatile FROM pg_proc WHERE proname = 'idempotency_asgi_claim'"
        " AND pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())"
    )
    assert volatility in ("v", b"v")
    locked = source.index("pg_try_advisory_lock(p_key_lock)")
    read = source.index("INTO found_row")
    assert source.index("pg_try_advisory_lock(p_request_lock)") < locked < read
    assert "END IF;" in source[locked:read]  # the read is a statement of its own


async def test_a_rollback_lets_the_requests_lock_go_in_its_own_round_trip(schema, tenant):
    """Behind a pooler in transaction mode the round trip after a ROLLBACK may reach another
    server connection: the request's lock (the session's) must go with the ROLLBACK, as it
    goes with the COMMIT, not in the reset that follows."""
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    app = build_app(schema, store=store, atomic=True)
    try:
        async with client(app) as http:
            await http.post("/tx/charge", json={}, headers=headers(tenant, "warm"))
            await counter.count()
            counter.queries.clear()
            failed = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, new_key(), x_status="500")
            )
            await counter.count()
    finally:
        await store.close()
    assert failed.status_code == 500
    rollbacks = [q for q in counter.queries if q.startswith("ROLLBACK")]
    assert rollbacks and all("SELECT pg_advisory_unlock(" in q for q in rollbacks), rollbacks


async def test_a_storm_of_replays_of_one_key_shares_its_looks(schema, tenant):
    """Forty replays of one key at once: while one looks at the key on a connection of its
    own, the others ride on the store's shared look (one row for all of them), so the
    database runs a few looks, not forty."""
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    app = build_app(schema, store=store, atomic=True)
    key = new_key()
    try:
        async with client(app) as http:
            first = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            await counter.count()
            counter.queries.clear()
            replays = await asyncio.gather(
                *(http.post("/tx/charge", json={}, headers=headers(tenant, key)) for _ in range(40))
            )
            await counter.count()
    finally:
        await store.close()
    assert all(r.content == first.content for r in replays)
    assert all(r.headers["idempotent-replayed"] == "true" for r in replays)
    looks = [q for q in counter.queries if "pg_try_advisory_xact_lock_shared" in q]
    assert 1 <= len(looks) <= 20, len(looks)


async def test_forty_concurrent_duplicates_make_one_effect(schema, db, tenant):
    process = serve(schema)
    key = new_key()
    try:
        async with wire(process.url) as http:
            answers = await asyncio.gather(
                *(
                    http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="200"))
                    for _ in range(40)
                )
            )
            replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        process.stop()
    statuses = Counter(a.status_code for a in answers)
    assert statuses[201] >= 1 and set(statuses) <= {201, 409}, statuses
    assert statuses[409] >= 1  # they really overlapped
    originals = {a.content for a in answers if a.status_code == 201}
    assert originals == {replay.content} and replay.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


async def test_waiting_duplicates_get_the_replay_when_the_first_commits(schema, db, tenant):
    process = serve(schema, wait_seconds=10)
    key = new_key()
    try:
        async with wire(process.url) as http:
            first = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="800"))
            )
            await running(db, tenant, key)
            duplicates = await asyncio.gather(
                *(http.post("/tx/charge", json={}, headers=headers(tenant, key)) for _ in range(10))
            )
            original = await first
    finally:
        process.stop()
    assert original.status_code == 201
    assert [d.status_code for d in duplicates] == [201] * 10
    assert all(d.headers["idempotent-replayed"] == "true" for d in duplicates)
    assert {d.content for d in duplicates} == {original.content}
    assert await effects(db, tenant, key) == 1


@pytest.mark.slow
async def test_a_server_killed_mid_handler_leaves_nothing_and_its_retry_runs_at_once(
    schema, db, tenant
):
    key = new_key()
    first = serve(schema, lease_seconds=60)
    try:
        async with wire(first.url) as http:
            doomed = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="5000"))
            )
            await running(db, tenant, key)
            await asyncio.sleep(0.2)  # its effect is written, uncommitted
            first.kill()
            with pytest.raises(httpx.TransportError):
                await doomed
    finally:
        first.stop()
    # PostgreSQL rolled the transaction back when the connection dropped: no effect, no row,
    # no lock, whatever the lease (60 s) would have said.
    assert await effects(db, tenant, key) == 0
    assert await key_row(db, tenant, key) is None
    second = serve(schema, lease_seconds=60)
    try:
        async with wire(second.url) as http:
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        second.stop()
    assert retry.status_code == 201, retry.text  # at once: not a 409 until a lease lapses
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == retry.content
    assert await effects(db, tenant, key) == 1


async def test_a_5xx_an_exception_or_a_cancellation_leaves_nothing(schema, db, tenant):
    app = build_app(schema, atomic=True)
    keys = {name: new_key() for name in ("5xx", "raise", "cancel")}
    async with client(app) as http:
        failed = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, keys["5xx"], x_status="503")
        )
        with pytest.raises(RuntimeError):
            await http.post(
                "/tx/charge", json={}, headers=headers(tenant, keys["raise"], x_raise="1")
            )
        cancelled = asyncio.create_task(
            http.post(
                "/tx/charge", json={}, headers=headers(tenant, keys["cancel"], x_delay_ms="2000")
            )
        )
        await running(db, tenant, keys["cancel"])
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        retries = {
            name: await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            for name, key in keys.items()
        }
    assert failed.status_code == 503
    for name, key in keys.items():
        # Everything rolled back, and the key was free at once: the retry ran.
        assert retries[name].status_code == 201, (name, retries[name].text)
        assert await effects(db, tenant, key) == 1, name


async def test_an_outcome_unknown_holds_the_key_in_flight(schema, db, tenant):
    app = build_app(schema, atomic=True, lease_seconds=30)
    key = new_key()
    async with client(app) as http:
        unknown = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_unknown="1")
        )
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert_problem(unknown, 504, "outcome-unknown")
    # Its writes rolled back; the key is held in flight, renewed by nobody, as in the other
    # modes: no retry runs before the lease lapses.
    assert_problem(retry, 409, "request-in-progress")
    assert await effects(db, tenant, key) == 0
    assert (await key_row(db, tenant, key))["state"] == "in_flight"


async def test_a_caught_database_error_answered_4xx_is_recorded_apart(schema, db, tenant):
    app = build_app(schema, atomic=True)
    async with client(app) as http:
        name = f"n-{new_key()}"
        await http.post("/tx/name", content=name, headers=headers(tenant, new_key()))
        key = new_key()
        refused = await http.post("/tx/name", content=name, headers=headers(tenant, key))
        replay = await http.post("/tx/name", content=name, headers=headers(tenant, key))
    assert refused.status_code == 409, refused.text  # the app's own answer to the duplicate
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == refused.content


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "transactional"])
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
async def test_the_transaction_runs_at_the_configured_isolation_level(
    schema, db, tenant, atomic, level
):
    # The atomic mode's transaction has run the key's statements before the handler has it,
    # so a handler cannot SET TRANSACTION ISOLATION LEVEL itself: the option sets it, for
    # both modes.
    app = build_app(schema, atomic=atomic, isolation_level=level)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/isolation", json={}, headers=headers(tenant, key))
        replay = await http.post("/tx/isolation", json={}, headers=headers(tenant, key))
        # Every lock let go of with the COMMIT's reset (the request's lock included, which
        # the session holds at these levels), while the connections are still open.
        held = await db.fetchval(
            "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)"
            " WHERE l.locktype = 'advisory' AND a.state = 'idle'"
            " AND a.datname = current_database()"
        )
    assert held == 0
    assert first.status_code == 201, first.text
    assert first.json()["isolation"] == level
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == first.content
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("mode", MODES)
async def test_a_handlers_own_savepoints_are_savepoints_of_the_request(schema, db, tenant, mode):
    # asyncpg's `async with conn.transaction()` on the request's connection: a savepoint of
    # the store's transaction, whose undoing leaves the rest, committed with the record once.
    app = app_in_mode(schema, mode)
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_savepoint="1")
        )
        replay = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_savepoint="1")
        )
    assert first.status_code == 201, first.text
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == first.content
    paths = await db.fetch(
        "SELECT path FROM effects WHERE tenant = $1 AND idempotency_key = $2", tenant, key
    )
    assert sorted(row["path"] for row in paths) == ["/tx/charge", "savepoint"]
    assert (await key_row(db, tenant, key))["response_status"] == 201


@pytest.mark.parametrize(
    ("level", "run_class"), [("read committed", ShortRun), ("repeatable read", AtomicRun)]
)
async def test_a_request_leaves_no_reference_cycle_behind(
    schema, tenant, level, run_class, monkeypatch
):
    # What a request makes is freed as it ends, by reference counting: garbage that only
    # the collector can free makes it run more often, and longer, under load (a run that
    # held itself was a cycle per request: 8 times as many collections as the same
    # transaction written by hand). Each path's run is checked to have run.
    runs: list[object] = []
    made = run_class.__init__

    def counted(self, *args, **kwargs):
        runs.append(type(self))
        made(self, *args, **kwargs)

    monkeypatch.setattr(run_class, "__init__", counted)
    app = build_app(schema, atomic=True, isolation_level=level)
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))  # warm
        gc.collect()
        gc.garbage.clear()
        gc.disable()
        try:
            gc.set_debug(gc.DEBUG_SAVEALL)
            for _ in range(5):
                answer = await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
                assert answer.status_code == 201, answer.text
            gc.collect()
            cycles = _ours_in_cycles(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert runs.count(run_class) == 6, runs
    assert cycles == [], cycles


def _ours_in_cycles(garbage: list[object]) -> list[str]:
    """The library's objects among `garbage` that reach themselves again (a cycle of their
    own, not merely held by someone else's)."""
    among = {id(o) for o in garbage}
    found = []
    for start in garbage:
        if not type(start).__module__.startswith("idempotency_asgi"):
            continue
        seen, todo = {id(start)}, list(gc.get_referents(start))
        while todo:
            one = todo.pop()
            if one is start:
                found.append(type(start).__qualname__)
                break
            if id(one) in among and id(one) not in seen:
                seen.add(id(one))
                todo.extend(gc.get_referents(one))
    return found


# -- a rolling deploy: atomic and other servers on one database --------------------------------


@pytest.fixture
def both(schema):
    atomic, plain = serve(schema), serve(schema, atomic=False)
    yield atomic, plain
    atomic.stop()
    plain.stop()


@pytest.mark.parametrize("first_mode", ["atomic", "transactional"])
async def test_mixed_servers_see_each_others_keys_in_flight(both, db, tenant, first_mode):
    atomic, plain = both
    runs, then = (atomic, plain) if first_mode == "atomic" else (plain, atomic)
    key = new_key()
    async with wire(runs.url) as first_http, wire(then.url) as other_http:
        first = asyncio.create_task(
            first_http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="600"))
        )
        await running(db, tenant, key)
        during = await other_http.post("/tx/charge", json={}, headers=headers(tenant, key))
        original = await first
        after = await other_http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert original.status_code == 201
    assert_problem(during, 409, "request-in-progress")
    assert after.headers["idempotent-replayed"] == "true" and after.content == original.content
    assert await effects(db, tenant, key) == 1


async def test_a_storm_across_mixed_servers_makes_one_effect(both, db, tenant):
    atomic, plain = both
    key = new_key()
    async with wire(atomic.url) as a, wire(plain.url) as p:
        answers = await asyncio.gather(
            *(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="100"))
                for _ in range(20)
                for http in (a, p)
            )
        )
    statuses = Counter(r.status_code for r in answers)
    assert set(statuses) <= {201, 409} and statuses[201] >= 1, statuses
    assert len({r.content for r in answers if r.status_code == 201}) == 1
    assert await effects(db, tenant, key) == 1


# -- the database goes away -------------------------------------------------------------------


@pytest.mark.slow
async def test_a_database_restart_fails_closed_and_loses_nothing(tenant):
    server = LocalPostgres.temporary()
    dsn = server.start()
    try:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        await conn.execute(EFFECTS_DDL)
        await conn.close()
        app = build_app(dsn, store=PostgresStore(dsn, timeout=1.0), atomic=True)
        async with client(app) as http:
            before = await http.post("/tx/charge", json={}, headers=headers(tenant, "k1"))
            server.crash()
            down = await http.post("/tx/charge", json={}, headers=headers(tenant, "k2"))
            dsn = server.restart()
            after = await eventually(lambda: _answered(http, tenant, "k2"), timeout=20)
            replay = await http.post("/tx/charge", json={}, headers=headers(tenant, "k1"))
        conn = await asyncpg.connect(dsn)
        try:
            counts = dict(
                await conn.fetch(
                    "SELECT idempotency_key, count(*) FROM effects GROUP BY idempotency_key"
                )
            )
        finally:
            await conn.close()
    finally:
        server.stop()
    assert before.status_code == 201
    assert_problem(down, 503, "store-unavailable")
    assert after.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == before.content
    assert counts == {"k1": 1, "k2": 1}


async def _answered(http: httpx.AsyncClient, tenant: str, key: str):
    response = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    return response if response.status_code != 503 else None


async def test_a_slow_commit_answers_503_in_time_and_a_retry_replays(schema, db, tenant):
    # Over the wire: the answer goes at the timeout while the COMMIT goes on in the request's
    # own call (an in-process transport hands the answer over only when that call returns).
    process = serve(schema, store={"timeout": 0.5})
    key = new_key()
    try:
        async with wire(process.url) as http:
            started = time.monotonic()
            slow = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, key, x_slow_commit="1.5")
            )
            took = time.monotonic() - started
            # Until the COMMIT lands, its transaction holds the key: a retry is told 409.
            meanwhile = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            await claimed(db, tenant, key)  # the COMMIT landed: the record is there
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        process.stop()
    assert took < 1.2, took
    assert_problem(slow, 503, "store-unavailable")
    assert_problem(meanwhile, 409, "request-in-progress")
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


# -- what the review of the atomic mode found ------------------------------------------------


async def test_an_outcome_unknown_on_an_expired_key_still_holds_it(schema, db, tenant):
    app = build_app(schema, atomic=True, ttl_seconds=0.5, lease_seconds=30)
    key = new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await asyncio.sleep(0.7)  # its record is past its retention: the key may run again
        unknown = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_unknown="1")
        )
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert_problem(unknown, 504, "outcome-unknown")
    # Held in place of the expired record it replaced: no retry runs before the lease lapses.
    assert_problem(retry, 409, "request-in-progress")
    assert (await key_row(db, tenant, key))["state"] == "in_flight"
    assert await effects(db, tenant, key) == 1  # the first; the unknown one's rolled back


async def test_a_slow_commit_keeps_its_connection_until_it_lands(schema, db, tenant, caplog):
    import logging

    app = build_app(schema, store=PostgresStore(schema, timeout=0.5), atomic=True)
    key = new_key()
    with caplog.at_level(logging.WARNING, logger="idempotency_asgi"):
        async with client(app) as http:
            slow = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, key, x_slow_commit="1.5")
            )
            await claimed(db, tenant, key)  # the COMMIT landed
            await eventually(lambda: _said(caplog, "landed"))
    assert_problem(slow, 503, "store-unavailable")
    # Its connection was the COMMIT's until the end, not closed under it.
    assert not _said_now(caplog, "lost its connection")


async def test_a_claim_answered_as_its_time_runs_out_runs_no_handler(schema, db, tenant):
    """The claim's answer and the timer's tick that finds it late, read by the loop in one
    pass (a loop busy past the deadline): the timer closed the claim's connection, so the
    request is the 503 at once, and its handler never runs on that closed connection."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from idempotency_asgi import IdempotencyMiddleware, connection
    from tests.apps import tenant_from_header
    from tests.relay import Relay

    ran: list[str] = []

    async def handler(request):
        ran.append(request.headers["idempotency-key"])
        await (await connection(request)).fetchval("SELECT 1")
        return Response(b"ok", status_code=201)

    async with Relay(schema) as relay:
        app = Starlette(routes=[Route("/x", handler, methods=["POST"])])
        store = PostgresStore(relay.dsn, timeout=0.5, min_size=1, max_size=1)
        app.add_middleware(
            IdempotencyMiddleware, store=store, tenant=tenant_from_header, atomic=True
        )
        async with client(app) as http:
            first = await http.post("/x", content=b"{}", headers=headers(tenant, new_key()))
            assert first.status_code == 201  # the store open, what it learns once learned
            key = new_key()
            relay.hold()
            request = asyncio.create_task(
                http.post("/x", content=b"{}", headers=headers(tenant, key))
            )
            await asyncio.sleep(0.2)  # the claim answered, its answer held in the relay
            relay.release()
            await asyncio.sleep(0)  # the relay passes the answer on (the next turn)...
            time.sleep(0.5)  # noqa: ASYNC251 - ...and the loop is busy past the deadline
            late = await request

            async def let_go() -> bool:  # its closed session's locks gone with it
                return not await key_locked(db, tenant, key)

            await eventually(let_go)
            again = await http.post("/x", content=b"{}", headers=headers(tenant, key))
    assert_problem(late, 503, "store-unavailable")
    assert again.status_code == 201, again.text
    assert ran.count(key) == 1  # the retry's run: the late claim's never began


async def test_a_request_cancelled_while_it_commits_leaves_nothing_behind(schema, db, tenant):
    # Cancelled (a server's forced shutdown) while its COMMIT is in flight: asyncpg cancels
    # the statement, the connection is closed, the server decides the COMMIT alone (here the
    # cancel reaches it first: rolled back), and this process forgets the run: a retry is
    # not told 409 from memory for ever, and the effect happens once.
    app = build_app(schema, store=PostgresStore(schema, timeout=5.0), atomic=True)
    key = new_key()
    async with client(app) as http:
        request = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_slow_commit="1"))
        )

        def committing() -> Any:
            return sessions(db, "%idempotency_asgi_record%COMMIT%")

        await eventually(committing)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await eventually(lambda: _not(committing))
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        locks = await db.fetchval(
            "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)"
            " WHERE l.locktype = 'advisory' AND a.state = 'idle'"
        )
    assert retry.status_code == 201, retry.text
    assert locks == 0
    assert await effects(db, tenant, key) == 1


async def _not(probe) -> bool:
    return not await probe()


async def test_a_stream_whose_commit_is_late_keeps_it_and_its_callbacks(schema, db, tenant):
    # A streamed answer (its record commits when it starts) whose COMMIT outlives the
    # timeout: answered 503, and its application does not hear that its client left until the
    # COMMIT has ended (Starlette would cancel the stream, and the COMMIT with it). It lands,
    # its after-commit callback runs, and the retry is told what it committed.
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from idempotency_asgi import IdempotencyMiddleware, after_commit, connection
    from tests.apps import tenant_from_header

    ran: list[str] = []

    async def events(request):
        conn = await connection(request)
        key = request.headers["idempotency-key"]
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, 'stream')",
            request.headers["x-tenant"],
            key,
        )
        await conn.execute("INSERT INTO slow_commits (seconds) VALUES (1.5)")
        after_commit(request, lambda: ran.append(key))

        async def chunks():
            yield b"data: 1\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/events", events, methods=["POST"])])
    store = PostgresStore(schema, timeout=0.5)
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant_from_header, atomic=True)
    key = new_key()
    async with client(app) as http:
        late = await http.post("/events", content=b"{}", headers=headers(tenant, key))
        await claimed(db, tenant, key)
        retry = await http.post("/events", content=b"{}", headers=headers(tenant, key))
    assert_problem(late, 503, "store-unavailable")
    assert ran == [key]
    assert await effects(db, tenant, key) == 1
    assert_problem(retry, 409, "response-not-replayable")


async def _said(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return _said_now(caplog, words)


def _said_now(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return any(words in record.getMessage() for record in caplog.records)


async def test_a_record_written_over_at_repeatable_read_is_told_409(schema, db, tenant):
    # A writer that takes no lock (an older server, here the test's own connection) writes the
    # key's row while the request runs at REPEATABLE READ: its record cannot be written over
    # it, and PostgreSQL says so as a serialization failure. That is the key taken (409), not
    # a conflict to retry (503).
    app = build_app(schema, atomic=True, isolation_level="repeatable read", ttl_seconds=0.5)
    key = new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await asyncio.sleep(0.7)  # expired: the next request replaces the record
        running_request = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="500"))
        )
        await running(db, tenant, key)
        await asyncio.sleep(0.1)
        await db.execute(
            "UPDATE idempotency_keys SET lease_token = 42, expires_at = now() + interval '1 day'"
            " WHERE tenant_id = $1 AND idempotency_key = $2",
            tenant,
            key,
        )
        taken = await running_request
    assert_problem(taken, 409, "request-in-progress")
    assert await effects(db, tenant, key) == 1  # the first only


async def test_a_claim_never_takes_over_a_key_an_atomic_transaction_holds(schema, db, tenant):
    from idempotency_asgi._postgres.keyhash import key_lock
    from idempotency_asgi._records import Outcome

    store = PostgresStore(schema, batch=False)
    key = new_key()
    try:
        first = await store.claim(
            tenant=tenant,
            key=key,
            method="POST",
            path="/x",
            fingerprint=b"f" * 32,
            lease_seconds=10,
            ttl_seconds=0.3,
        )
        assert first.lease is not None
        await store.complete(first.lease, _RESPONSE, ttl_seconds=0.3)
        await asyncio.sleep(0.4)  # expired
        async with db.acquire() as atomic, atomic.transaction():
            # What an atomic transaction replacing that record holds while its handler runs.
            await atomic.execute("SELECT pg_advisory_xact_lock($1)", key_lock(tenant, key))
            second = await store.claim(
                tenant=tenant,
                key=key,
                method="POST",
                path="/x",
                fingerprint=b"f" * 32,
                lease_seconds=10,
                ttl_seconds=60,
            )
    finally:
        await store.close()
    assert second.outcome is Outcome.IN_FLIGHT  # not EXPIRED: that transaction runs it


async def test_duplicates_that_look_together_run_once_and_hold_nothing(schema, db, tenant):
    """Five duplicates of a new key at once: each looks on its own connection and finds the
    key free, so each tries the locks; one has them and runs, the others find them taken,
    roll back at once and answer 409, holding nothing (the connection's session is left as it
    was: no lock of theirs survives)."""
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    calls: list[str] = []
    app = build_app(schema, store=store, calls=calls, atomic=True)
    key = new_key()
    try:
        async with client(app) as http:
            await http.post("/tx/charge", json={}, headers=headers(tenant, "warm"))
            await counter.count()
            counter.queries.clear()
            calls.clear()
            answers = await asyncio.gather(
                *(
                    http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="200"))
                    for _ in range(5)
                )
            )
            await counter.count()
    finally:
        await store.close()
    assert sorted(a.status_code for a in answers) == [201, 409, 409, 409, 409]
    assert calls == ["/tx/charge"] and await effects(db, tenant, key) == 1
    begins = [q for q in counter.queries if q.startswith("BEGIN")]
    rollbacks = [q for q in counter.queries if q.startswith("ROLLBACK")]
    assert len(rollbacks) == len(begins) - 1  # every BEGIN but the one that ran
    assert not await key_locked(db, tenant, key)


_RESPONSE = StoredResponse(status=201, headers=[], body=b"{}")
