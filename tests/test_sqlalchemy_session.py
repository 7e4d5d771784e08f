"""SQLAlchemy sessions in the request's transaction (idempotency_asgi.sqlalchemy), in the
two-phase transactional mode and in the atomic mode, against the suite's PostgreSQL: the
session's writes commit with the key's record or not at all, its commit is a savepoint's,
and the lent connection comes back as the store lent it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import ResourceClosedError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session as SyncSession
from starlette.types import ASGIApp

import idempotency_asgi.sqlalchemy
from idempotency_asgi import PostgresStore, TransactionEnded
from tests.helpers import assert_problem, key_row, lifespan, new_key, running
from tests.server import UvicornProcess
from tests.sqlalchemy_apps import TABLES, Order, build_app

MODES = ["transactional", "atomic"]


@pytest.fixture(scope="module")
async def sa_schema(schema: str) -> str:
    conn = await asyncpg.connect(schema)
    try:
        await conn.execute(TABLES)
    finally:
        await conn.close()
    return schema


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.asynccontextmanager
async def client(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    """In process, with the lifespan; an exception the app raises is its 500, as a server's."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        yield http


def keyed(tenant: str, key: str, **extra: str) -> dict[str, str]:
    return {
        "x-tenant": tenant,
        "idempotency-key": key,
        **{k.replace("_", "-"): v for k, v in extra.items()},
    }


async def notes(db: asyncpg.Pool, tenant: str, key: str | None = None) -> list[str]:
    rows = await db.fetch(
        "SELECT note FROM sa_orders WHERE tenant = $1"
        " AND ($2::text IS NULL OR idempotency_key = $2) ORDER BY id",
        tenant,
        key,
    )
    return [row["note"] for row in rows]


# -- in process: what the session does in the request's transaction ---------------------------


async def test_a_committed_row_commits_with_the_record_and_is_replayed(sa_schema, db, tenant, mode):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        first = await http.post("/orders", json={}, headers=keyed(tenant, key))
        retry = await http.post("/orders", json={}, headers=keyed(tenant, key))
    assert first.status_code == 201, first.text
    assert first.json()["details"] == {"note": "order", "nested": {"n": 1}}
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    assert await notes(db, tenant, key) == ["order"]
    assert (await key_row(db, tenant, key))["state"] == "completed"


@pytest.mark.parametrize("then", ["flush-raise", "commit-raise"])
async def test_a_raise_after_flush_or_commit_leaves_no_row_and_the_retry_runs(
    sa_schema, db, tenant, mode, then
):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        failed = await http.post("/orders", json={}, headers=keyed(tenant, key, x_then=then))
        assert failed.status_code == 500
        # session.commit() released a savepoint only: the key's transaction rolled back.
        assert await notes(db, tenant, key) == []
        assert await key_row(db, tenant, key) is None
        retry = await http.post("/orders", json={}, headers=keyed(tenant, key))
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert await notes(db, tenant, key) == ["order"]


async def test_a_5xx_answer_rolls_the_sessions_committed_writes_back(sa_schema, db, tenant, mode):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        failed = await http.post("/orders", json={}, headers=keyed(tenant, key, x_status="503"))
        retry = await http.post("/orders", json={}, headers=keyed(tenant, key))
    assert failed.status_code == 503
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert await notes(db, tenant, key) == ["order"]


async def test_a_4xx_raised_rolls_the_session_back_to_its_last_commit(sa_schema, db, tenant, mode):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        first = await http.post("/orders/refused", json={}, headers=keyed(tenant, key))
        retry = await http.post("/orders/refused", json={}, headers=keyed(tenant, key))
    assert first.status_code == 409 and "idempotent-replayed" not in first.headers
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    assert await notes(db, tenant, key) == ["committed"]


@pytest.mark.parametrize(
    ("sqlstate", "problem"),
    [
        ("40001", "transaction-conflict"),  # serialization_failure
        ("40P01", "transaction-conflict"),  # deadlock_detected
        ("57014", "store-unavailable"),  # query_canceled (statement_timeout)
        ("55P03", "store-unavailable"),  # lock_not_available (lock_timeout)
    ],
)
async def test_a_database_failure_through_the_session_is_answered_as_through_the_connection(
    sa_schema, db, tenant, mode, sqlstate, problem
):
    # SQLAlchemy wraps the driver's error (DBAPIError, caused by its adapter's error, caused by
    # asyncpg's): the middleware reads the cause, as it reads the error from connection(request).
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        failed = await http.post(
            "/orders/sqlstate", json={}, headers=keyed(tenant, key, x_sqlstate=sqlstate)
        )
        assert_problem(failed, 503, problem)
        assert int(failed.headers["retry-after"]) >= 1
        # Nothing kept: the session's committed savepoint went with the key's transaction.
        assert await notes(db, tenant, key) == []
        assert await key_row(db, tenant, key) is None
        retry = await http.post("/orders/sqlstate", json={}, headers=keyed(tenant, key))
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert await notes(db, tenant, key) == ["order"]


@pytest.mark.parametrize("then", ["flush", "refuse"])
async def test_a_dependency_cleaned_up_before_the_response_keeps_the_same_rules(
    sa_schema, db, tenant, mode, then
):
    # FastAPI runs a dependency's cleanup before the response with scope="function", after it
    # by default: what is kept does not depend on which.
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post(
            "/orders/function-scope", json={}, headers=keyed(tenant, key, x_then=then)
        )
    if then == "flush":
        assert answer.status_code == 201
        assert await notes(db, tenant, key) == ["function-scope"]
    else:
        assert answer.status_code == 409
        assert await notes(db, tenant, key) == []


async def test_rollback_undoes_only_what_the_session_did_since_its_last_commit(
    sa_schema, db, tenant, mode
):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/orders/savepoints", json={}, headers=keyed(tenant, key))
    assert answer.status_code == 201, answer.text
    assert answer.json() == {"notes": ["kept", "after"]}
    assert await notes(db, tenant, key) == ["kept", "after"]


async def test_the_session_and_the_connection_share_one_transaction(sa_schema, db, tenant, mode):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/orders/mixed", json={}, headers=keyed(tenant, key))
        failed = await http.post(
            "/orders/mixed", json={}, headers=keyed(tenant, new_key(), x_status="500")
        )
    assert answer.status_code == 201, answer.text
    assert answer.json() == {"session_saw": 1, "connection_saw": 2}
    assert await notes(db, tenant, key) == ["raw", "orm"]
    assert failed.status_code == 201  # /orders/mixed ignores x-status: both kept, once
    assert len(await notes(db, tenant)) == 4


async def test_a_sqlmodel_table_model_works_through_the_same_dependency(
    sa_schema, db, tenant, mode
):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        first = await http.post("/heroes", json={}, headers=keyed(tenant, key))
        retry = await http.post("/heroes", json={}, headers=keyed(tenant, key))
    assert first.status_code == 201, first.text
    hero = first.json()
    assert hero["name"] == "Deadpond" and isinstance(hero["id"], int)
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    count = await db.fetchval("SELECT count(*) FROM sa_heroes WHERE tenant = $1", tenant)
    assert count == 1


async def test_a_replay_a_409_or_a_422_never_opens_a_session(sa_schema, db, tenant, mode):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        slow = asyncio.create_task(
            http.post("/orders", json={}, headers=keyed(tenant, key, x_delay_ms="600"))
        )
        await running(db, tenant, key)
        busy = await http.post("/orders", json={}, headers=keyed(tenant, key))
        first = await slow
        reused = await http.post("/orders", json={"other": 1}, headers=keyed(tenant, key))
        replay = await http.post("/orders", json={}, headers=keyed(tenant, key))
    assert first.status_code == 201
    assert busy.status_code == 409 and reused.status_code == 422
    assert replay.headers["idempotent-replayed"] == "true"
    assert await notes(db, tenant, key) == ["order"]


async def test_changes_never_flushed_are_not_written_and_a_warning_says_so(
    sa_schema, db, tenant, mode, caplog
):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    with caplog.at_level(logging.WARNING, logger="idempotency_asgi"):
        async with client(app) as http:
            answer = await http.post(
                "/orders", json={}, headers=keyed(tenant, key, x_then="nothing")
            )
    assert answer.status_code == 201
    assert await notes(db, tenant, key) == []
    assert any("never flushed" in record.getMessage() for record in caplog.records)


async def test_flushed_but_not_committed_is_kept_with_the_record(sa_schema, db, tenant, mode):
    # What the session sent is part of the request's transaction, as a statement sent on
    # the connection is: closing the session after the answer does not take it back.
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/orders", json={}, headers=keyed(tenant, key, x_then="flush"))
    assert answer.status_code == 201
    assert await notes(db, tenant, key) == ["order"]


# -- the lent connection comes back as it was lent ---------------------------------------------


@pytest.mark.parametrize("shared_pool", [False, True], ids=["own-pool", "shared-pool"])
async def test_the_pooled_connection_decodes_json_as_before_a_session_used_it(
    sa_schema, db, tenant, mode, shared_pool
):
    # One connection in the pool: the session's request and the raw one after it use the
    # same server session (pid). SQLAlchemy's asyncpg dialect would set json and jsonb codecs
    # on a connection it opens; a codec left on this one would make the raw handler, and the
    # store where it shares the pool, read dicts where they read text.
    pool = None
    if shared_pool:
        pool = await asyncpg.create_pool(sa_schema, min_size=1, max_size=1)
        store = PostgresStore(pool)
    else:
        store = PostgresStore(sa_schema, min_size=1, max_size=1)
    app = build_app(sa_schema, store=store, atomic=mode == "atomic")
    try:
        async with client(app) as http:
            before = await http.post("/json", json={}, headers=keyed(tenant, new_key()))
            orm = await http.post("/orders/json", json={}, headers=keyed(tenant, new_key()))
            after = await http.post("/json", json={}, headers=keyed(tenant, new_key()))
            replay_key = new_key()
            again = [
                await http.post("/orders/json", json={}, headers=keyed(tenant, replay_key))
                for _ in range(2)
            ]
    finally:
        if pool is not None:
            await pool.close()
    assert orm.status_code == 201, orm.text
    # SQLAlchemy's JSONB type decodes, without a codec on the connection.
    assert orm.json()["details"] == {"note": "json", "nested": {"n": 1}}
    assert orm.json()["read"] == {"b": 2}
    assert orm.json()["untyped"] == '{"b": 2}'
    assert before.json() == {"jsonb": "str", "json": "str", "pid": before.json()["pid"]}
    assert after.json() == before.json()  # the same connection, decoding as before
    assert orm.json()["pid"] == before.json()["pid"]
    assert again[1].headers["idempotent-replayed"] == "true"  # the store reads its records


@pytest.mark.parametrize("route", ["/keep", "/keep-unclosed"])
async def test_a_session_kept_after_its_request_never_reaches_the_connection_again(
    sa_schema, db, tenant, mode, route
):
    # The one pooled connection serves a second request while the first request's session,
    # kept by the application, is used again: its statements are refused, its rollback sends
    # nothing (a ROLLBACK TO SAVEPOINT there would abort the second request's transaction).
    store = PostgresStore(sa_schema, min_size=1, max_size=1)
    app = build_app(sa_schema, store=store, atomic=mode == "atomic")
    first_key, second_key = new_key(), new_key()
    async with client(app) as http:
        kept = await http.post(route, json={}, headers=keyed(tenant, first_key))
        assert kept.status_code == 201, kept.text
        [session] = app.state.kept
        second = asyncio.create_task(
            http.post("/orders", json={}, headers=keyed(tenant, second_key, x_delay_ms="500"))
        )
        await running(db, tenant, second_key)
        # Closed by the dependency (SQLAlchemy refuses), or not (the request's transaction
        # has ended: TransactionEnded); either way nothing is sent.
        with pytest.raises((TransactionEnded, ResourceClosedError)):
            await session.execute(text("SELECT 1"))
        await session.rollback()  # nothing to send: the savepoint ended with its request
        with pytest.raises((TransactionEnded, ResourceClosedError)):
            session.add(Order(tenant=tenant, idempotency_key=first_key, note="late"))
            await session.commit()
        answer = await second
    assert answer.status_code == 201, answer.text
    assert await notes(db, tenant, second_key) == ["order"]
    # The first request's flushed row went with its record.
    assert await notes(db, tenant, first_key) == ["kept-session"]


async def test_a_background_task_cannot_use_the_session(sa_schema, db, tenant, mode):
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/background", json={}, headers=keyed(tenant, key))
    assert answer.status_code == 202
    assert app.state.kept == [["connection: ended", "session: ended"]]
    assert await notes(db, tenant, key) == ["handler"]


async def test_two_first_calls_at_once_in_a_new_process_share_one_session(
    sa_schema, db, tenant, mode, monkeypatch
):
    # The process's engine learns the server's version and defaults on its first session,
    # once: two first calls at once must not both run that on the request's one connection.
    from idempotency_asgi._sqlalchemy.engine import Engine

    monkeypatch.setattr(idempotency_asgi.sqlalchemy, "_engine", Engine())
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/orders/gathered", json={}, headers=keyed(tenant, key))
    assert answer.status_code == 201, answer.text
    assert answer.json() == {"same": True}
    assert await notes(db, tenant, key) == ["gathered"]
    assert (await key_row(db, tenant, key))["state"] == "completed"


@pytest.mark.parametrize(
    "option",
    [
        "isolation_level=SERIALIZABLE",
        "isolation_level=AUTOCOMMIT",
        "postgresql_readonly=true",
        "postgresql_deferrable=true",
    ],
)
async def test_a_session_asking_for_other_transaction_settings_gets_transaction_ended(
    sa_schema, db, tenant, mode, option
):
    # The request's transaction began with the middleware's isolation level, before the
    # session existed: a session cannot change it, and is told so, the rest of it unharmed.
    app = build_app(sa_schema, atomic=mode == "atomic")
    key = new_key()
    async with client(app) as http:
        answer = await http.post(
            "/orders/option", json={}, headers=keyed(tenant, key, x_option=option)
        )
    assert answer.status_code == 201, answer.text
    assert "set isolation_level on the middleware" in answer.json()["refused"]
    assert await notes(db, tenant, key) == ["order"]
    assert (await key_row(db, tenant, key))["state"] == "completed"


# -- what the session factory may be ------------------------------------------------------------


@contextlib.asynccontextmanager
async def engine_of_yours(dsn: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        yield engine
    finally:
        idempotency_asgi.sqlalchemy.configure()  # the default again, for the other tests
        await engine.dispose()


async def test_a_factory_with_binds_is_refused_when_configured(sa_schema):
    # Per-model binds send the model's writes to an engine of the application's, outside the
    # request's transaction: a commit there survives a raise, and the retry writes again.
    async with engine_of_yours(sa_schema) as engine:
        with pytest.raises(ValueError, match="binds"):
            idempotency_asgi.sqlalchemy.configure(
                async_sessionmaker(binds={Order: engine}, expire_on_commit=False)
            )


async def test_a_session_made_with_binds_is_refused_and_writes_nothing(sa_schema, db, tenant, mode):
    async with engine_of_yours(sa_schema) as engine:
        # Accepted when configured (a plain callable, or binds given to the factory later),
        # refused when a session is made: before the handler writes anything.
        sessions = async_sessionmaker(expire_on_commit=False)
        idempotency_asgi.sqlalchemy.configure(sessions)
        sessions.configure(binds={Order: engine})
        app = build_app(sa_schema, atomic=mode == "atomic")
        key = new_key()
        async with client(app) as http:
            failed = await http.post(
                "/orders", json={}, headers=keyed(tenant, key, x_then="commit-raise")
            )
            again = await http.post(
                "/orders", json={}, headers=keyed(tenant, key, x_then="commit-raise")
            )
    assert failed.status_code == again.status_code == 500
    assert await notes(db, tenant, key) == []  # neither attempt wrote through the engine
    assert await key_row(db, tenant, key) is None


async def test_a_routing_session_class_is_refused(sa_schema):
    # SQLAlchemy's documented way to route statements between engines: a Session whose
    # get_bind chooses one. The request's connection would be bypassed as with binds.
    async with engine_of_yours(sa_schema) as engine:

        class Routing(SyncSession):
            def get_bind(self, mapper=None, clause=None, **kw):  # type: ignore[no-untyped-def,override]
                return engine.sync_engine

        with pytest.raises(ValueError, match="get_bind"):
            idempotency_asgi.sqlalchemy.configure(
                async_sessionmaker(sync_session_class=Routing, expire_on_commit=False)
            )
        from idempotency_asgi.sqlalchemy import _has_binds

        assert _has_binds(AsyncSession(sync_session_class=Routing))
        assert not _has_binds(AsyncSession(sync_session_class=SyncSession))


def test_binds_are_found_where_each_sqlalchemy_release_keeps_them():
    # SQLAlchemy 2.1 has a public `Session.binds`; 2.0 keeps them in a private attribute; a
    # release with neither is checked when the factory is configured only.
    from types import SimpleNamespace

    from idempotency_asgi.sqlalchemy import _has_binds

    engine = create_async_engine("postgresql+asyncpg://nowhere/none")
    assert _has_binds(AsyncSession(binds={Order: engine}))
    assert not _has_binds(AsyncSession())
    for where in ("binds", "_Session__binds"):
        made = SimpleNamespace(sync_session=SimpleNamespace(**{where: {Order: engine}}))
        assert _has_binds(made)  # type: ignore[arg-type]
        empty = SimpleNamespace(sync_session=SimpleNamespace(**{where: {}}))
        assert not _has_binds(empty)  # type: ignore[arg-type]
    assert not _has_binds(SimpleNamespace(sync_session=SimpleNamespace()))  # type: ignore[arg-type]


# -- over HTTP, against a real uvicorn ----------------------------------------------------------


def serve(dsn: str, mode: str, lease_seconds: float = 10) -> UvicornProcess:
    env = {
        "DATABASE_URL": dsn,
        "TEST_SA_SERVE": "1",
        "TEST_SA_ATOMIC": "1" if mode == "atomic" else "0",
        "IDEMPOTENCY_LEASE_SECONDS": str(lease_seconds),
    }
    return UvicornProcess("tests.sqlalchemy_apps:app", env).start(ready_path="/ready")


@pytest.mark.slow
async def test_thirty_concurrent_duplicates_write_one_row_through_the_session(
    sa_schema, db, tenant, mode
):
    server = serve(sa_schema, mode)
    key = new_key()
    try:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as http:
            answers = await asyncio.gather(
                *(
                    http.post("/orders", json={}, headers=keyed(tenant, key, x_delay_ms="300"))
                    for _ in range(30)
                )
            )
            after = await http.post("/orders", json={}, headers=keyed(tenant, key))
    finally:
        server.stop()
    ran = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(ran) == 1, [a.status_code for a in answers]
    assert {a.status_code for a in answers} <= {201, 409}
    assert after.content == ran[0].content and after.headers["idempotent-replayed"] == "true"
    assert await notes(db, tenant, key) == ["order"]


@pytest.mark.slow
async def test_kill_9_during_the_handler_leaves_no_row_and_the_retry_runs(
    sa_schema, db, tenant, mode
):
    lease = 1.0
    first = serve(sa_schema, mode, lease_seconds=lease)
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as http:
            doomed = asyncio.create_task(
                http.post("/orders", json={}, headers=keyed(tenant, key, x_delay_ms="5000"))
            )
            await running(db, tenant, key)
            await asyncio.sleep(0.3)  # the row is committed to its savepoint, not to the database
            first.kill()
            with pytest.raises(httpx.TransportError):
                await doomed
    finally:
        first.stop()
    assert await notes(db, tenant, key) == []
    second = serve(sa_schema, mode, lease_seconds=lease)
    try:
        async with httpx.AsyncClient(base_url=second.url, timeout=30) as http:
            retry = await http.post("/orders", json={}, headers=keyed(tenant, key))
            if mode == "atomic":
                # The transaction was the lease: the key is free at once.
                assert retry.status_code == 201, retry.text
            else:
                # The dead owner's lease lapses first (1 s), then a retry takes it over.
                assert retry.status_code in (201, 409), retry.text
                deadline = asyncio.get_running_loop().time() + 10
                while retry.status_code == 409:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(float(retry.headers.get("retry-after", "1")) / 2)
                    retry = await http.post("/orders", json={}, headers=keyed(tenant, key))
            replay = await http.post("/orders", json={}, headers=keyed(tenant, key))
    finally:
        second.stop()
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert replay.content == retry.content and replay.headers["idempotent-replayed"] == "true"
    assert await notes(db, tenant, key) == ["order"]


@pytest.mark.parametrize("adapter", ["absent", "refuses"])
async def test_without_the_dialects_adapter_class_sessions_are_made_sqlalchemys_way(
    sa_schema, db, tenant, monkeypatch, adapter
):
    # Sessions are made with the asyncpg dialect's adapter class, an undocumented name;
    # where a SQLAlchemy release lacks it, or makes it another way, the dialect's own
    # connect (through SQLAlchemy's greenlet) makes it instead.
    from idempotency_asgi._sqlalchemy import engine as _lent_engine

    def refuses(*args: object) -> None:
        raise TypeError("made another way")

    monkeypatch.setattr(_lent_engine, "ADAPTER", None if adapter == "absent" else refuses)
    app = build_app(sa_schema)
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/orders/savepoints", json={}, headers=keyed(tenant, key))
    assert answer.status_code == 201, answer.text
    assert await notes(db, tenant, key) == ["kept", "after"]
