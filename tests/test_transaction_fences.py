"""The transactional modes' fences, over HTTP against a real uvicorn and a real PostgreSQL,
with the database audited afterwards:

- a store made from the application's own small pool: a request never needs a second
  connection of it while it holds one (it would wait for itself);
- a handler that commits or rolls back the request's transaction itself: no duplicate runs
  meanwhile, the record is never written outside that transaction, and the answer says so;
- SERIALIZABLE: the store's own statements make unrelated keys' transactions fail nobody;
- a retry of the same request is never told 422 when the owner ends between two lock tries.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import asyncpg
import pytest

from idempotency_asgi._postgres import sql
from idempotency_asgi._postgres.keyhash import key_lock, request_lock
from tests import server
from tests.helpers import assert_problem, effects, headers, key_row, new_key, running
from tests.server import wire


def serve(schema: str, pool_size: int | None, **options):
    """The test app, every route atomic unless told; its store on an application's pool of
    `pool_size` connections, or on its own DSN (None)."""
    env = {} if pool_size is None else {"TEST_APP_POOL_SIZE": str(pool_size)}
    return server.serve(schema, options={"atomic": True, **options}, **env)


STORES = pytest.mark.parametrize("pool_size", [1, None], ids=["app-pool-1", "dsn"])


# -- the application's pool: never a second connection ----------------------------------------


@STORES
async def test_an_outcome_unknown_holds_its_key_whatever_the_pool(schema, db, tenant, pool_size):
    process = serve(schema, pool_size)
    key = new_key()
    try:
        async with wire(process.url) as http:
            first = await http.post(
                "/fan-out", content=b"{}", headers=headers(tenant, key, x_group="unknown")
            )
            retry = await http.post(
                "/fan-out", content=b"{}", headers=headers(tenant, key, x_group="unknown")
            )
    finally:
        process.stop()
    assert_problem(first, 504, "outcome-unknown")
    assert_problem(retry, 409, "request-in-progress")  # held: not run a second time
    row = await key_row(db, tenant, key)
    assert row is not None and row["state"] == "in_flight"
    assert await effects(db, tenant, key) == 1  # the external call, once


@pytest.mark.parametrize("slow", [0, 3], ids=["three-unknowns-pool-3", "three-slow-pool-4"])
async def test_outcome_unknowns_on_a_busy_pool_each_hold_their_key(schema, db, tenant, slow):
    """Every connection of the pool is taken when the holds are written: by three
    OutcomeUnknowns at once on a pool of three, or by three slow requests and one
    OutcomeUnknown on a pool of four."""
    unknown = [new_key() for _ in range(1 if slow else 3)]
    process = serve(schema, 3 + (1 if slow else 0))

    def fail(http, k):
        return http.post("/fan-out", content=b"{}", headers=headers(tenant, k, x_group="unknown"))

    try:
        async with wire(process.url) as http:
            slow_keys = [new_key() for _ in range(slow)]
            busy = [
                asyncio.ensure_future(
                    http.post("/tx/charge", json={}, headers=headers(tenant, k, x_delay_ms="1500"))
                )
                for k in slow_keys
            ]
            for k in slow_keys:
                await running(db, tenant, k)
            answers = await asyncio.gather(*(fail(http, k) for k in unknown))
            retries = await asyncio.gather(*(fail(http, k) for k in unknown))
            finished = await asyncio.gather(*busy)
    finally:
        process.stop()
    assert [a.status_code for a in finished] == [201] * slow
    for answer, retry in zip(answers, retries, strict=True):
        assert_problem(answer, 504, "outcome-unknown")
        assert_problem(retry, 409, "request-in-progress")
    for k in unknown:
        assert await effects(db, tenant, k) == 1


@STORES
async def test_a_caught_database_error_answered_4xx_is_recorded_on_a_pool_of_one(
    schema, db, tenant, pool_size
):
    process = serve(schema, pool_size)
    name, key = f"n-{new_key()}", new_key()
    try:
        async with wire(process.url) as http:
            created = await http.post("/tx/name", content=name, headers=headers(tenant, new_key()))
            refused = await http.post("/tx/name", content=name, headers=headers(tenant, key))
            replay = await http.post("/tx/name", content=name, headers=headers(tenant, key))
    finally:
        process.stop()
    assert created.status_code == 201
    assert refused.status_code == 409, refused.text  # the application's own answer
    assert replay.status_code == 409 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == refused.content
    assert await effects(db, tenant, key) == 0  # its write rolled back with the failed INSERT


@pytest.mark.parametrize("pool_size", [1, 3])
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
async def test_new_keys_at_a_strict_isolation_level_never_wait_for_themselves(
    schema, db, tenant, pool_size, level
):
    process = serve(schema, pool_size, isolation_level=level)
    keys = [new_key() for _ in range(12)]
    try:
        async with wire(process.url) as http:
            loop = asyncio.get_running_loop()
            started = loop.time()
            answers = await asyncio.gather(
                *(http.post("/tx/charge", json={}, headers=headers(tenant, k)) for k in keys)
            )
            took = loop.time() - started
    finally:
        process.stop()
    assert [a.status_code for a in answers] == [201] * 12, [a.text for a in answers]
    assert took < 1.5  # no request waited out the store's timeout (2 s) for a connection
    for k in keys:
        assert await effects(db, tenant, k) == 1


async def test_a_bound_on_stored_keys_works_on_a_pool_of_one(schema, db, tenant):
    process = serve(schema, 1, max_keys_per_tenant=1000)
    keys = [new_key() for _ in range(3)]
    try:
        async with wire(process.url) as http:
            answers = [
                await http.post("/tx/charge", json={}, headers=headers(tenant, k)) for k in keys
            ]
    finally:
        process.stop()
    assert [a.status_code for a in answers] == [201] * 3, [a.text for a in answers]


async def test_waiting_duplicates_keep_no_connection_of_a_small_pool(schema, db, tenant):
    """With `wait_seconds`, duplicates of an atomic request wait on its lock: no listener
    keeps one of the pool's two connections, and new keys still run at REPEATABLE READ."""
    process = serve(schema, 2, wait_seconds=5, isolation_level="repeatable read")
    key = new_key()
    try:
        async with wire(process.url) as http:
            first = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="600"))
            )
            await running(db, tenant, key)
            waiting = await asyncio.gather(
                *(http.post("/tx/charge", json={}, headers=headers(tenant, key)) for _ in range(3))
            )
            original = await first
            others = await asyncio.gather(
                *(
                    http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
                    for _ in range(6)
                )
            )
    finally:
        process.stop()
    assert original.status_code == 201
    assert [w.status_code for w in waiting] == [201] * 3
    assert all(w.headers["idempotent-replayed"] == "true" for w in waiting)
    assert [o.status_code for o in others] == [201] * 6, [o.text for o in others]
    assert await effects(db, tenant, key) == 1


# -- a handler that ends the request's transaction itself -------------------------------------


#: How the handler goes on after ending the transaction: it answers 201, raises, answers 500.
THEN = {"answers": {}, "raises": {"x_raise": "1"}, "answers-500": {"x_status": "500"}}


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "two-phase"])
@pytest.mark.parametrize("ending", ["COMMIT", "ROLLBACK"])
@pytest.mark.parametrize("pool_size", [2, None], ids=["app-pool-2", "dsn"])
@pytest.mark.parametrize("then", list(THEN))
async def test_a_handler_that_ends_the_transaction_itself_is_found_out(
    schema, db, tenant, atomic, ending, pool_size, then
):
    process = serve(schema, pool_size, atomic=atomic)
    key = new_key()
    sent = headers(tenant, key, x_end_transaction=ending, x_delay_ms="800", **THEN[then])
    try:
        async with wire(process.url) as http:
            first = asyncio.create_task(http.post("/tx/charge", json={}, headers=sent))
            await running(db, tenant, key)
            await asyncio.sleep(0.3)  # the handler has sent its COMMIT or ROLLBACK
            duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            answer = await first
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        process.stop()
    assert_problem(duplicate, 409, "request-in-progress")  # the key stayed held throughout
    assert_problem(answer, 500, "transaction-ended-by-handler")
    assert_problem(retry, 409, "request-in-progress")  # held until its lease lapses
    # What the handler committed stays (once); what it rolled back is gone. Nothing else ran.
    assert await effects(db, tenant, key) == (1 if ending == "COMMIT" else 0)
    row = await key_row(db, tenant, key)
    assert row is not None and row["state"] == "in_flight"  # never recorded as answered


# -- SERIALIZABLE ------------------------------------------------------------------------------


@pytest.mark.parametrize("atomic", [False, True], ids=["two-phase", "atomic"])
async def test_at_serializable_unrelated_keys_never_fail_each_other(schema, db, tenant, atomic):
    """Forty keys at once, five times, against a handler in the request's transaction that
    runs no statement of its own: the only statements in the transactions are the store's."""
    process = serve(schema, None, atomic=atomic, isolation_level="serializable")
    try:
        async with wire(process.url) as http:
            answers = []
            for _ in range(5):
                answers += await asyncio.gather(
                    *(
                        http.post("/tx/touch", json={}, headers=headers(tenant, new_key()))
                        for _ in range(40)
                    )
                )
    finally:
        process.stop()
    statuses = Counter(a.status_code for a in answers)
    assert statuses == {201: 200}, [a.text for a in answers if a.status_code != 201][:3]


# -- a retry is never told 422 ----------------------------------------------------------------


async def test_a_retry_racing_its_owners_end_is_never_told_the_key_was_reused(schema, db):
    """An owner takes the locks and lets them go, again and again, as atomic requests of one
    request do; first looks and claims of that same request run meanwhile. None may read
    'mismatch': that is a 422 telling a client its key was reused when it was not. (Tried in
    the other order, the key's lock then the request's, a look found the key's held and the
    request's free whenever the owner ended in between.)"""
    tenant, key, fingerprint = "t-race", new_key(), b"\x01" * 32
    locks = key_lock(tenant, key), request_lock(tenant, key, fingerprint)
    owner = await asyncpg.connect(schema)
    lookers = [await asyncpg.connect(schema) for _ in range(3)]
    stop = asyncio.Event()
    seen: Counter[str] = Counter()
    owned = 0

    async def own() -> None:
        # As an atomic request does: BEGIN with the locks, then COMMIT with the request's
        # lock let go of in the same round trip (the key's goes with the COMMIT, first).
        nonlocal owned
        while not stop.is_set():
            status = await owner.execute(sql.begin_locked(*locks))
            if status == "SELECT 1":
                owned += 1
                await owner.execute("COMMIT; " + sql.release_locks(locks[1]))
            else:
                await owner.execute("ROLLBACK")

    async def look(conn: asyncpg.Connection) -> None:
        while not stop.is_set():
            row = await conn.fetchrow(sql.PEEK, tenant, key, fingerprint, *locks)
            seen[row["state"] if row["state"] != "absent" else "free"] += 1

    async def claim(conn: asyncpg.Connection) -> None:
        args = (tenant, key, "POST", "/x", fingerprint, 1, 10.0, 10.0, 1, *locks)
        while not stop.is_set():
            tx = conn.transaction()
            await tx.start()
            try:  # a claim of a free key inserts it: rolled back at once
                row = await conn.fetchrow(sql.CLAIM, *args)
            finally:
                await tx.rollback()
            seen["free" if row is None or row["claimed"] else row["state"]] += 1

    tasks = [
        asyncio.ensure_future(own()),
        asyncio.ensure_future(look(lookers[0])),
        asyncio.ensure_future(look(lookers[1])),
        asyncio.ensure_future(claim(lookers[2])),
    ]
    try:
        await asyncio.sleep(3)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in (owner, *lookers):
            await conn.execute("SELECT pg_advisory_unlock_all()")
            await conn.close()
    assert owned > 100 and seen["locked"] > 100, (owned, seen)  # they really raced
    assert seen["mismatch"] == 0, seen


@pytest.mark.parametrize("level", ["repeatable read", "serializable", "read committed"])
async def test_a_duplicate_that_looked_before_the_first_committed_gets_its_replay(
    schema, db, tenant, level
):
    """Both connections handlers borrow are taken, so two copies of one request look at the
    key on the store's own connections (nobody has it) and queue for one. The first runs and
    commits; the second has its connection only then. Its transaction's snapshot (at
    REPEATABLE READ, SERIALIZABLE) can be no newer than its locks: unless the key's row is
    read again after them, it runs the request a second time."""
    process = server.serve(
        schema,
        store={"max_size": 2, "timeout": 6},
        options={"atomic": True, "isolation_level": level},
    )
    key = new_key()
    try:
        async with wire(process.url) as http:
            busy = [
                asyncio.ensure_future(
                    http.post(
                        "/tx/charge", json={}, headers=headers(tenant, new_key(), x_delay_ms=ms)
                    )
                )
                for ms in ("1000", "2500")
            ]
            await asyncio.sleep(0.3)  # both hold their connections
            first = asyncio.ensure_future(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="300"))
            )
            await asyncio.sleep(0.1)
            second = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            original = await first
            await asyncio.gather(*busy)
    finally:
        process.stop()
    assert original.status_code == 201
    assert second.status_code == 201 and second.headers["idempotent-replayed"] == "true"
    assert second.content == original.content
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("pool_size", [2, None], ids=["app-pool-2", "dsn"])
async def test_an_outcome_unknown_whose_session_died_still_holds_its_key(
    schema, db, tenant, pool_size
):
    """The request's own connection is gone when the handler gives up (its backend ended
    meanwhile: a failover, an idle-in-transaction timeout): the hold is written on another
    connection, and the retry is told 409, not run."""
    process = serve(schema, pool_size)
    key = new_key()
    try:
        async with wire(process.url) as http:
            first = asyncio.ensure_future(
                http.post(
                    "/tx/charge",
                    json={},
                    headers=headers(tenant, key, x_delay_ms="800", x_unknown="1"),
                )
            )
            await running(db, tenant, key)
            pid = await db.fetchval(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND objsubid = 1 AND ((classid::int8 << 32) | objid::int8) = $1",
                key_lock(tenant, key),
            )
            assert await db.fetchval("SELECT pg_terminate_backend($1)", pid)
            answer = await first
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        process.stop()
    assert_problem(answer, 504, "outcome-unknown")
    assert_problem(retry, 409, "request-in-progress")
    row = await key_row(db, tenant, key)
    assert row is not None and row["state"] == "in_flight"


async def test_waiting_on_a_held_key_keeps_no_connection_of_the_applications_pool(
    schema, db, tenant
):
    """A key held in flight by a row (after OutcomeUnknown), and a duplicate that waits for
    it (`wait_seconds`) on a store made from the application's pool of one: no listener takes
    that one connection for good, and the requests after it still run."""
    process = serve(schema, 1, wait_seconds=1)
    key = new_key()
    try:
        async with wire(process.url) as http:
            unknown = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, key, x_unknown="1")
            )
            waited = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            after = [
                await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
                for _ in range(3)
            ]
    finally:
        process.stop()
    assert_problem(unknown, 504, "outcome-unknown")
    assert_problem(waited, 409, "request-in-progress")  # the wait ran out; it never ran
    assert [a.status_code for a in after] == [201] * 3, [a.text for a in after]
