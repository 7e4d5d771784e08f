"""Every failure ends in a named, bounded outcome: handlers that fan out, a busy pool, a
database that never answers, a slow COMMIT, a store that refuses. Real uvicorn processes
where the wire matters, and the database audited afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from email.utils import parsedate_to_datetime

import asyncpg
import httpx
import pytest

from idempotency_asgi import PostgresStore
from idempotency_asgi.maintenance import BackgroundMaintenance, Reaper, Sweeper
from tests import modes
from tests.apps import build_app
from tests.helpers import (
    assert_problem,
    client,
    effects,
    eventually,
    headers,
    key_locked,
    key_row,
    new_key,
    running,
)
from tests.server import serve, wire

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


async def timed(request) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await request
    return response, time.monotonic() - started


# -- an "outcome unknown" inside a task group ------------------------------------------------


@pytest.fixture(scope="module")
def fan_out_server(schema):
    # A pool of one, and a short timeout: a child that asks for the request's connection
    # while another request holds it gets "store unavailable" inside its task group.
    process = serve(
        schema, store={"min_size": 1, "max_size": 1, "timeout": 0.5}, IDEMPOTENCY_LEASE_SECONDS="30"
    )
    yield process
    process.stop()


@pytest.mark.parametrize("library", ["asyncio", "anyio", "with-a-cancellation"])
async def test_outcome_unknown_from_a_task_group_holds_the_key(fan_out_server, db, tenant, library):
    key = new_key()
    if library == "with-a-cancellation":
        sent = headers(tenant, key, x_group="unknown-and-cancelled")
    else:
        sent = headers(tenant, key, x_group="unknown", x_group_lib=library)
    async with wire(fan_out_server.url) as http:
        first = await http.post("/fan-out", content=b"{}", headers=sent)
        retry = await http.post("/fan-out", content=b"{}", headers=sent)
    body = assert_problem(first, 504, "outcome-unknown")
    assert int(first.headers["retry-after"]) >= 1, body
    # Held, not released: the retry does not run the effect a second time.
    assert_problem(retry, 409, "request-in-progress")
    row = await key_row(db, tenant, key)
    assert row is not None and row["state"] == "in_flight"
    assert await effects(db, tenant, key) == 1


async def test_store_unavailable_inside_a_task_group_is_a_503(fan_out_server, db, tenant):
    holder, key = new_key(), new_key()
    async with wire(fan_out_server.url) as http:
        # This one holds the pool's only connection for 1.5 s.
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, holder, x_delay_ms="1500"))
        )
        await running(db, tenant, holder)
        await asyncio.sleep(0.2)  # it has asked for its connection by now
        refused = await http.post(
            "/fan-out", content=b"{}", headers=headers(tenant, key, x_group="store")
        )
        assert (await slow).status_code == 201
        retried = await http.post(
            "/fan-out", content=b"{}", headers=headers(tenant, key, x_group="store")
        )
    assert_problem(refused, 503, "store-unavailable")
    assert retried.status_code == 201  # released, not left to its lease: the retry ran
    assert await effects(db, tenant, key) == 1


async def test_any_other_error_in_a_task_group_still_frees_the_key(fan_out_server, db, tenant):
    key = new_key()
    sent = headers(tenant, key, x_group="error")
    answers = []
    for _ in range(2):  # a connection of its own each: uvicorn closes one after a 500
        async with wire(fan_out_server.url) as http:
            answers.append(await http.post("/fan-out", content=b"{}", headers=sent))
    first, retry = answers
    assert first.status_code == 500 and retry.status_code == 500
    assert await key_row(db, tenant, key) is None
    assert await effects(db, tenant, key) == 2  # each attempt ran: that is what a 500 means


@pytest.mark.parametrize(
    ("sqlstate", "status", "problem"),
    [
        # The server going down: its error can reach the handler before the socket is seen
        # closed (here the session even lives on, to make sure of that).
        ("57P01", 503, "store-unavailable"),  # admin_shutdown
        ("57P02", 503, "store-unavailable"),  # crash_shutdown
        ("53300", 503, "store-unavailable"),  # too_many_connections
        # A conflict with a concurrent transaction, uncaught in the handler.
        ("40001", 503, "transaction-conflict"),
        ("40P01", 503, "transaction-conflict"),
    ],
)
async def test_a_database_error_the_handler_did_not_catch_is_no_500(
    schema, db, tenant, sqlstate, status, problem
):
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        failed = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_raise_sqlstate=sqlstate)
        )
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert_problem(failed, status, problem)
    assert int(failed.headers["retry-after"]) >= 1
    assert retry.status_code == 201  # released, and the first one's write rolled back
    assert await effects(db, tenant, key) == 1


def raised_from(error: BaseException, links: int) -> BaseException:
    """`error` wrapped `links` times, each wrapper raised from the one before (`__cause__`)."""
    for n in range(links):
        wrapper = RuntimeError(f"wrapper {n}")
        wrapper.__cause__ = error
        error = wrapper
    return error


def test_the_database_error_is_read_through_a_few_links_of_causes():
    # A library on the connection raises its own error from asyncpg's (SQLAlchemy: two links):
    # the database's error is found along `__cause__`, a bounded number of links deep.
    from idempotency_asgi._postgres.connections import CAUSE_LINKS, handler_failure

    conflict = asyncpg.exceptions.SerializationError("could not serialize access")
    assert handler_failure(raised_from(conflict, 2)) == "conflict"
    assert handler_failure(raised_from(conflict, CAUSE_LINKS)) == "conflict"
    assert handler_failure(raised_from(conflict, CAUSE_LINKS + 1)) is None
    timeout = asyncpg.exceptions.QueryCanceledError("canceling statement due to timeout")
    assert handler_failure(raised_from(timeout, 2)) == "outage"
    # The first database error found decides: a refusal for good is the application's.
    assert handler_failure(raised_from(asyncpg.exceptions.UniqueViolationError("dup"), 2)) is None
    # An OutcomeUnknown on the way says what the error means: the key is held (see below).
    from idempotency_asgi import OutcomeUnknown

    unknown = OutcomeUnknown("the ledger did not answer in time")
    unknown.__cause__ = timeout
    wrapped = RuntimeError("the charge failed")
    wrapped.__cause__ = unknown
    assert handler_failure(wrapped) is None
    # An error raised while another was handled (its __context__ only) is the handler's own.
    try:
        try:
            raise conflict
        except asyncpg.PostgresError:
            raise RuntimeError("the handler's own, while handling it")  # noqa: B904
    except RuntimeError as own:
        assert handler_failure(own) is None


def test_an_exception_raised_from_its_own_group_is_looked_at_once():
    # `except* ValueError as group: raise group.exceptions[0] from group`: the member's cause
    # is the group that holds it. Looking for an OutcomeUnknown went round that for ever (a
    # RecursionError out of the run: the key neither released nor settled).
    from idempotency_asgi import OutcomeUnknown
    from idempotency_asgi._asgi.execution import find

    member = ValueError("the provider refused")
    group = BaseExceptionGroup("fan-out", [member])
    member.__cause__ = group
    assert find(member, OutcomeUnknown) is None
    assert find(group, OutcomeUnknown) is None
    unknown = OutcomeUnknown("the ledger did not answer in time")
    member.__cause__ = BaseExceptionGroup("again", [group, unknown])
    assert find(member, OutcomeUnknown) is unknown


@pytest.mark.parametrize("atomic", [False, True], ids=["two-phase", "atomic"])
async def test_an_outcome_unknown_the_application_wrapped_still_holds_the_key(
    schema, db, tenant, atomic
):
    # `raise ChargeFailed(...) from unknown`, the OutcomeUnknown itself raised from a statement
    # timeout: the key is held (504), not freed for a retry that may charge again (a 503 read
    # through to the timeout), nor left to a bare 500.
    app = build_app(schema, atomic=atomic)
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, **{"x-unknown-wrapped": "1"})
        )
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert_problem(first, 504, "outcome-unknown")
    assert_problem(retry, 409, "request-in-progress")
    row = await key_row(db, tenant, key)
    assert row is not None and row["state"] == "in_flight"
    assert await effects(db, tenant, key) == 0  # its writes rolled back with the transaction


# -- waiting duplicates under a busy pool -----------------------------------------------------


@modes.own_connections  # the waiters' looks go to the store's own connections
async def test_waiting_duplicates_never_need_a_handlers_connection(schema, db, tenant):
    # A pool of two, both held by slow transactional handlers; six duplicates of one of them
    # wait up to a second each for its result.
    process = serve(schema, store={"max_size": 2, "timeout": 0.5}, options={"wait_seconds": 1})
    try:
        first, second = new_key(), new_key()
        async with wire(process.url) as http:
            slow = [
                asyncio.create_task(
                    http.post("/tx/charge", json={}, headers=headers(tenant, k, x_delay_ms="3000"))
                )
                for k in (first, second)
            ]
            await running(db, tenant, first)
            await running(db, tenant, second)
            await asyncio.sleep(0.3)  # both hold their connections now
            duplicates = await asyncio.gather(
                *(
                    timed(http.post("/tx/charge", json={}, headers=headers(tenant, first)))
                    for _ in range(6)
                )
            )
            originals = await asyncio.gather(*slow)
            after = await http.post("/tx/charge", json={}, headers=headers(tenant, first))
    finally:
        process.stop()
    for response, seconds in duplicates:
        # The wait ran out (the first needs 3 s): a 409, after about wait_seconds.
        assert_problem(response, 409, "request-in-progress")
        assert 0.9 <= seconds < 2.0, seconds
    assert [r.status_code for r in originals] == [201, 201]
    assert after.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, first) == 1


async def test_the_maintenance_runner_does_not_take_a_handlers_connection(schema, db, tenant):
    store = PostgresStore(schema, max_size=1, timeout=0.5)
    maintenance = BackgroundMaintenance(Reaper(store), Sweeper(store), idle_seconds=0.2)
    app = build_app(schema, store=store, maintenance=maintenance)
    key = new_key()
    async with client(app) as http:
        await asyncio.sleep(0.5)  # elected, and holding its lock
        response = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        # It really runs: its lock is held by a backend of its own.
        holders = await db.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = $1",
            0x72656170,
        )
    assert response.status_code == 201
    assert holders == 1
    assert await effects(db, tenant, key) == 1


# -- a database that never answers -----------------------------------------------------------


@contextlib.contextmanager
def silent_database() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word, as a hung server does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for sock in held:
            sock.close()
        listener.close()


@modes.own_connections  # an application's own pool that cannot open fails its startup
async def test_a_store_that_never_opened_fails_every_request_within_its_timeout(schema, tenant):
    with silent_database() as port:
        process = serve(
            schema,
            store={"timeout": 0.5},
            STORE_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{port}/postgres",
        )
        try:
            async with wire(process.url) as http:
                concurrent = await asyncio.gather(
                    *(
                        timed(
                            http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))
                        )
                        for _ in range(8)
                    )
                )
                # Later ones: while the failure is remembered they fail at once, and after it
                # a new attempt is made, shared again.
                later = [
                    await timed(
                        http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))
                    )
                    for _ in range(6)
                ]
                passthrough = await http.get("/read")
        finally:
            process.stop()
    for response, seconds in concurrent + later:
        assert_problem(response, 503, "store-unavailable")
        # Each within its own timeout (0.5 s), with a margin for a shared machine; before,
        # each made its own attempt in turn: 0.5, 1.0 ... 4.0 s.
        assert seconds < 1.2, [round(s, 2) for _, s in concurrent + later]
    assert passthrough.status_code == 200


# -- a COMMIT slower than the timeout ---------------------------------------------------------


async def test_a_slow_commit_answers_503_in_time_and_its_record_is_replayed(schema, db, tenant):
    application = f"slow-commit-{uuid.uuid4().hex[:8]}"
    process = serve(
        schema,
        store={
            "timeout": 1.0,
            "pool_options": {"server_settings": {"application_name": application}},
        },
    )
    key = new_key()
    try:
        async with wire(process.url) as http:
            request = asyncio.create_task(
                timed(
                    http.post(
                        "/tx/charge", json={}, headers=headers(tenant, key, x_slow_commit="3")
                    )
                )
            )
            committing = await eventually(
                lambda: db.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
                    " AND (query LIKE 'COMMIT%' OR query LIKE '%; COMMIT;%') AND state = 'active'",
                    application,
                )
            )
            response, seconds = await request
            # The COMMIT goes on: it was not cancelled, so it lands (or fails) as PostgreSQL
            # decides, and a retry then finds its record.
            done = await eventually(
                lambda: db.fetchval(
                    "SELECT state = 'completed' FROM idempotency_keys"
                    " WHERE tenant_id = $1 AND idempotency_key = $2",
                    tenant,
                    key,
                ),
                timeout=10,
            )
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            # Its connection is never handed out again: closed once the COMMIT ended.
            gone = await eventually(
                lambda: db.fetchval(
                    "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", committing
                )
            )
    finally:
        process.stop()
    assert_problem(response, 503, "store-unavailable")
    assert seconds < 2.0, seconds  # the timeout is 1 s; the COMMIT takes 3
    assert done and gone
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


async def test_a_commit_that_fails_after_the_timeout_frees_the_key(schema, db, tenant):
    # Over the wire: the atomic mode answers at the timeout while the COMMIT goes on in the
    # request's own call (an in-process transport would hand the answer over only after).
    process = serve(schema, store={"timeout": 0.5})
    key = new_key()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(process.stop)
        http = await stack.enter_async_context(wire(process.url))
        task = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_slow_commit="1.5"))
        )
        await running(db, tenant, key)
        row = await key_row(db, tenant, key)
        # Cancel the COMMIT's deferred trigger from outside: the transaction rolls back.
        pid = await eventually(
            lambda: db.fetchval(
                "SELECT pid FROM pg_stat_activity"
                " WHERE (query LIKE 'COMMIT%' OR query LIKE '%; COMMIT;%') AND state = 'active'"
                " AND pid <> pg_backend_pid()"
            )
        )
        response = await task
        await db.execute("SELECT pg_cancel_backend($1)", pid)
        released = await eventually(lambda: _free(db, tenant, key))
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    if modes.atomic():
        assert row is None  # its lock held the key; the row comes with the COMMIT
    else:
        assert row["state"] == "in_flight"
    assert_problem(response, 503, "store-unavailable")
    assert released
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert await effects(db, tenant, key) == 1  # the first one's write rolled back


async def _absent(db: asyncpg.Pool, tenant: str, key: str) -> bool:
    return await key_row(db, tenant, key) is None


async def _free(db: asyncpg.Pool, tenant: str, key: str) -> bool:
    """No row, and no transaction holding the key (the atomic mode's lock)."""
    return not await key_locked(db, tenant, key) and await _absent(db, tenant, key)


# -- retention counts from the answer ---------------------------------------------------------


async def test_retention_counts_from_when_the_answer_was_recorded(schema, db, tenant):
    app = build_app(schema, ttl_seconds=2)
    key = new_key()
    async with client(app) as http:
        # The handler spends 2.5 s inside its transaction, longer than the retention.
        first = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="2500")
        )
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert first.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    expires = parsedate_to_datetime(first.headers["idempotency-key-expires"])
    assert expires.timestamp() > time.time() + 0.5  # not already in the past
    assert await effects(db, tenant, key) == 1


# -- deterministic failures are not outages ---------------------------------------------------


async def test_a_tenant_id_too_long_to_store_is_a_401_not_a_503(schema, db):
    long_tenant = "t" * 4000
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        responses = [
            await http.post("/tx/charge", json={}, headers=headers(long_tenant, key))
            for _ in range(2)
        ]
    for response in responses:
        assert_problem(response, 401, "unauthenticated")
        assert "retry-after" not in response.headers
    assert await effects(db, long_tenant) == 0


@pytest.fixture
async def read_only_role(db, schema):
    """A login role that may read the key table but not write it: every claim is refused,
    for good, however often it is tried."""
    role = f"ro_{uuid.uuid4().hex[:8]}"
    await db.execute(f"CREATE ROLE {role} LOGIN")
    await db.execute(f"GRANT SELECT ON idempotency_keys, idempotency_leases TO {role}")
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(schema)
    host = parts.netloc.split("@", 1)[-1]
    yield urlunsplit(parts._replace(netloc=f"{role}@{host}"))
    await db.execute(f"REVOKE ALL ON idempotency_keys, idempotency_leases FROM {role}")
    await db.execute(f"DROP ROLE {role}")


async def test_a_store_that_refuses_for_good_is_a_500_named_once(
    schema, read_only_role, db, tenant, caplog
):
    calls: list[str] = []
    app = build_app(schema, store=PostgresStore(read_only_role), calls=calls)
    keys = [new_key(), new_key()]
    with caplog.at_level("INFO", logger="idempotency_asgi"):
        async with client(app) as http:
            responses = [
                await http.post("/plain/charge", json={}, headers=headers(tenant, key))
                for key in keys
            ]
    for response in responses:
        body = assert_problem(response, 500, "store-refused")
        assert "InsufficientPrivilegeError (42501)" in body["detail"]
        assert "retry-after" not in response.headers
    assert calls == []  # nothing ran
    lines = [r for r in caplog.records if hasattr(r, "idempotency")]
    # One loud line per request, naming the error; no other line about it, no retry loop.
    assert [r.levelname for r in lines] == ["ERROR", "ERROR"]
    assert all("InsufficientPrivilegeError" in r.getMessage() for r in lines)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert await effects(db, tenant) == 0


async def test_a_failing_init_leaks_no_connection(schema, db, tenant):
    application = f"init-{uuid.uuid4().hex[:8]}"
    failing = False

    async def init(conn) -> None:
        if failing:
            raise RuntimeError("init refused this connection")

    store = PostgresStore(
        schema,
        min_size=1,
        max_size=1,
        pool_options={"init": init, "server_settings": {"application_name": application}},
    )
    app = build_app(schema, store=store)
    count = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    async with client(app) as http:
        opened = await db.fetchval(count, application)  # the pool's, and one for statements
        # From now on every new connection fails its init; the ones there are go away.
        failing = True
        await db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            application,
        )
        await eventually(lambda: _none_left(db, application))
        responses = [
            await http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))
            for _ in range(5)
        ]
        await asyncio.sleep(0.2)
        left = await db.fetchval(count, application)
    assert opened == 2
    # The first may meet its connection's end; every later one fails the init, for good.
    assert all(r.status_code in (500, 503) for r in responses)
    for response in responses[1:]:
        assert_problem(response, 500, "store-refused")
    assert left == 0  # every connection whose init failed was closed
    assert await effects(db, tenant) == 0


async def _none_left(db: asyncpg.Pool, application: str) -> bool:
    count = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    return await db.fetchval(count, application) == 0
