"""The request's transaction whatever the handler does with it: catches a database error and
answers, swallows one, fails at something else, leaves work for after the response, or is
cancelled while its answer is being recorded. Real PostgreSQL, audited afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import asyncpg
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_asgi import IdempotencyMiddleware, PostgresStore, connection
from tests import modes
from tests.apps import build_app, tenant_from_header
from tests.helpers import (
    assert_problem,
    client,
    effects,
    eventually,
    headers,
    key_row,
    new_key,
    running,
)


async def test_a_4xx_after_a_caught_database_error_is_recorded_and_replayed(schema, db, tenant):
    calls: list[str] = []
    app = build_app(schema, calls=calls)
    key = new_key()
    async with client(app) as http:
        created = await http.post("/tx/name", content=b"acme", headers=headers(tenant, new_key()))
        # Another key, the same name: the INSERT fails, the handler catches it and says 409,
        # and its transaction is now aborted.
        exists = await http.post("/tx/name", content=b"acme", headers=headers(tenant, key))
        retry = await http.post("/tx/name", content=b"acme", headers=headers(tenant, key))
    assert created.status_code == 201
    assert exists.status_code == 409 and exists.json() == {"error": "exists"}
    assert "idempotency-key-expires" in exists.headers  # recorded, like any stored answer
    assert retry.status_code == 409 and retry.content == exists.content
    assert retry.headers["idempotent-replayed"] == "true"
    assert calls == ["/tx/name", "/tx/name"]  # the retry did not run the handler again
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed" and row["response_status"] == 409
    # The aborted transaction rolled back: only the first request's write is there.
    assert await effects(db, tenant) == 1


async def test_a_success_from_an_aborted_transaction_is_a_500_and_frees_the_key(schema, db, tenant):
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        await http.post("/tx/name", content=b"taken", headers=headers(tenant, new_key()))
        lie = await http.post("/tx/name-swallowed", content=b"taken", headers=headers(tenant, key))
        assert await key_row(db, tenant, key) is None  # released
        retry = await http.post("/tx/name-swallowed", content=b"free", headers=headers(tenant, key))
    body = assert_problem(lie, 500, "transaction-failed")
    assert "rolled back" in body["detail"]
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    # The swallowed request's write rolled back; the first and the retry's remain.
    assert await effects(db, tenant) == 2


async def test_an_oserror_from_a_third_party_call_is_not_a_store_outage(schema, db, tenant):
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        # The application's own failure: it propagates (the server answers 500), no 503.
        with pytest.raises(ConnectionRefusedError):
            await http.post("/tx/third-party", json={}, headers=headers(tenant, key))
        assert await key_row(db, tenant, key) is None  # released, so the retry runs fresh
    assert await effects(db, tenant, key) == 0  # its write rolled back


async def test_background_tasks_in_plain_mode_cannot_open_a_transaction(schema, db, tenant):
    application = f"bg-{uuid.uuid4().hex[:8]}"
    store = PostgresStore(
        schema, pool_options={"server_settings": {"application_name": application}}
    )
    app = build_app(schema, store=store)
    keys = [new_key() for _ in range(14)]  # more than the pool's ten connections

    async def scenario() -> tuple[list[str], int]:
        async with client(app) as http:
            for key in keys:
                response = await http.post("/plain/background", headers=headers(tenant, key))
                assert response.status_code == 202
            notes = await eventually(lambda: _notes(db, tenant, len(keys)), timeout=30)
            stuck = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
                application,
            )
        return notes, stuck

    # Bounded: a leaked transaction would also keep the pool from ever closing at shutdown.
    notes, stuck = await asyncio.wait_for(scenario(), timeout=60)
    assert stuck == 0
    assert set(notes) == {"background-refused:TransactionEnded"}, notes


async def _notes(db, tenant: str, expected: int) -> list[str] | None:
    rows = await db.fetch("SELECT path FROM effects WHERE tenant = $1 ORDER BY id", tenant)
    return [row["path"] for row in rows] if len(rows) >= expected else None


@modes.two_phase
async def test_a_request_cancelled_while_its_answer_is_recorded_still_settles(schema, db, tenant):
    app = build_app(schema, lease_seconds=10)
    key = new_key()
    async with client(app) as http, db.acquire() as blocker:
        request = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="300"))
        )
        await running(db, tenant, key)
        async with blocker.transaction():
            # Hold the key row: the completion will wait for it, mid-settlement.
            await blocker.execute(
                "SELECT 1 FROM idempotency_keys"
                " WHERE tenant_id = $1 AND idempotency_key = $2 FOR UPDATE",
                tenant,
                key,
            )
            await eventually(lambda: _completion_waiting(db))
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        # The cancellation did not leave the key in flight, nor a transaction open: the
        # answer, complete before the cancellation, is recorded and committed.
        row = await eventually(lambda: _settled(db, tenant, key))
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert row["state"] == "completed"
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


async def _completion_waiting(db) -> bool:
    return bool(
        await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND (query LIKE '%SET state = ''completed''%'"
            " OR query LIKE '%idempotency_asgi_complete(%')"
        )
    )


async def _settled(db, tenant: str, key: str):
    row = await key_row(db, tenant, key)
    return row if row is not None and row["state"] != "in_flight" else None


async def _tenant_role(db) -> None:
    """A role a handler switches to (row-level security, say), allowed what the transaction
    does with it: its writes, and the key row's completion."""
    await db.execute(
        """
        DO $$ BEGIN
            CREATE ROLE idempotency_test_tenant;
        EXCEPTION WHEN duplicate_object THEN NULL;
        END $$;
        GRANT idempotency_test_tenant TO current_user;
        GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public
            TO idempotency_test_tenant;
        """
    )


def _session_app(schema: str, store: PostgresStore) -> Starlette:
    """/dirty leaves every kind of session state on the request's connection (then answers
    with x-status); /look reports what the connection it is lent carries."""

    async def dirty(request: Request) -> Response:
        conn = await connection(request)
        await conn.execute("SET application_name = 'tenant-a'")
        await conn.execute("SET statement_timeout = '4321ms'")
        await conn.execute("SELECT pg_advisory_lock(4242)")
        await conn.execute("LISTEN tenant_a_events")
        await conn.execute("DECLARE held CURSOR WITH HOLD FOR SELECT 1")
        await conn.execute("CREATE TEMP TABLE IF NOT EXISTS scratch AS SELECT 'tenant-a' AS v")
        await conn.execute("SET ROLE idempotency_test_tenant")
        if "x-deferred" in request.headers:  # two equal names: caught by the COMMIT only
            await conn.execute(
                "INSERT INTO deferred_names VALUES ($1), ($1)", request.headers["x-deferred"]
            )
        return Response(b"dirty", status_code=int(request.headers.get("x-status", "201")))

    async def look(request: Request) -> Response:
        conn = await connection(request)
        seen = await conn.fetchrow(
            """
            SELECT pg_backend_pid() AS pid,
                   current_setting('application_name') AS application_name,
                   current_setting('statement_timeout') AS statement_timeout,
                   (SELECT count(*) FROM pg_locks
                     WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS advisory_locks,
                   (SELECT count(*) FROM pg_listening_channels()) AS channels,
                   (SELECT count(*) FROM pg_cursors) AS cursors,
                   current_user::text AS role,
                   (SELECT count(*) FROM pg_class
                     WHERE relnamespace = pg_my_temp_schema()) AS temporary_tables
            """
        )
        return Response(orjson.dumps(dict(seen)), status_code=201)

    async def note(request: Request) -> Response:
        # A deferred trigger reads the handler's SET LOCAL when the transaction commits.
        conn = await connection(request)
        await conn.execute("SELECT set_config('app.note', $1, true)", request.headers["x-note"])
        await conn.execute("INSERT INTO noted_rows VALUES (1)")
        return Response(b"noted", status_code=201)

    app = Starlette(
        routes=[
            Route("/dirty", dirty, methods=["POST"]),
            Route("/look", look, methods=["POST"]),
            Route("/note", note, methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant_from_header)
    return app


@pytest.mark.parametrize("pool", ["the store's", "the application's"])
@pytest.mark.parametrize("status", [201, 409, 500])
async def test_a_lent_connection_carries_no_session_state_into_the_next_request(
    schema, db, tenant, status, pool
):
    # One connection in the pool: the second request is lent the very connection the first
    # dirtied, whether its answer committed (201), was recorded outside its transaction (409)
    # or released the key (500); on a pool the store made, and on one the application passed
    # in (which keeps asyncpg's own reset).
    await _tenant_role(db)
    async with contextlib.AsyncExitStack() as stack:
        if pool == "the store's":
            store = PostgresStore(schema, min_size=1, max_size=1)
        else:
            own = await asyncpg.create_pool(schema, min_size=1, max_size=1)
            stack.push_async_callback(own.close)
            store = PostgresStore(own)
        app = _session_app(schema, store)
        async with client(app) as http:
            baseline = (await http.post("/look", headers=headers(tenant, new_key()))).json()
            dirtied = await http.post(
                "/dirty", headers=headers(tenant, new_key(), x_status=str(status))
            )
            seen = (await http.post("/look", headers=headers(tenant, new_key()))).json()
    assert dirtied.status_code == status
    assert seen["pid"] == baseline["pid"]  # the same server session, so the check means something
    assert seen["application_name"] == baseline["application_name"] != "tenant-a"
    assert seen["statement_timeout"] == baseline["statement_timeout"] != "4321ms"
    assert seen["advisory_locks"] == seen["channels"] == 0
    assert seen["cursors"] == baseline["cursors"]  # the protocol's own portal, no held cursor
    assert seen["role"] == baseline["role"] != "idempotency_test_tenant"
    assert seen["temporary_tables"] == 0


async def test_a_commit_that_fails_rolls_back_everything_and_leaves_the_session_clean(
    schema, db, tenant
):
    await db.execute(
        "CREATE TABLE IF NOT EXISTS deferred_names (name text UNIQUE DEFERRABLE INITIALLY DEFERRED)"
    )
    await _tenant_role(db)
    store = PostgresStore(schema, min_size=1, max_size=1)
    app = _session_app(schema, store)
    key, name = new_key(), f"n-{uuid.uuid4().hex}"
    async with client(app) as http:
        baseline = (await http.post("/look", headers=headers(tenant, new_key()))).json()
        failed = await http.post("/dirty", headers=headers(tenant, key, x_deferred=name))
        seen = (await http.post("/look", headers=headers(tenant, new_key()))).json()
        retry = await http.post("/dirty", headers=headers(tenant, key))
    # The handler said 201, but its writes did not commit: a 500, the key free for a retry.
    assert_problem(failed, 500, "transaction-failed")
    assert await db.fetchval("SELECT count(*) FROM deferred_names WHERE name = $1", name) == 0
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert seen["pid"] == baseline["pid"]
    assert seen["application_name"] == baseline["application_name"] != "tenant-a"
    assert seen["statement_timeout"] == baseline["statement_timeout"] != "4321ms"
    assert seen["advisory_locks"] == seen["channels"] == 0
    assert seen["cursors"] == baseline["cursors"]
    assert seen["role"] == baseline["role"] != "idempotency_test_tenant"
    assert seen["temporary_tables"] == 0


async def test_the_commit_runs_with_the_handlers_local_settings(schema, db, tenant):
    # What a deferred trigger (or synchronous_commit) sees at COMMIT is what the handler set
    # for its transaction: the session reset that shares the COMMIT's round trip comes after.
    await db.execute(
        """
        CREATE TABLE IF NOT EXISTS noted_rows (v int);
        CREATE TABLE IF NOT EXISTS notes_at_commit (note text);
        CREATE OR REPLACE FUNCTION note_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO notes_at_commit VALUES (current_setting('app.note', true));
            RETURN NULL;
        END $$;
        DROP TRIGGER IF EXISTS note_at_commit ON noted_rows;
        CREATE CONSTRAINT TRIGGER note_at_commit AFTER INSERT ON noted_rows
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION note_at_commit();
        """
    )
    note = f"note-{uuid.uuid4().hex}"
    app = _session_app(schema, PostgresStore(schema))
    async with client(app) as http:
        answer = await http.post("/note", headers=headers(tenant, new_key(), x_note=note))
    assert answer.status_code == 201
    assert await db.fetchval("SELECT count(*) FROM notes_at_commit WHERE note = $1", note) == 1
