"""The store takes the URLs applications hold: SQLAlchemy's `postgresql+asyncpg://` (what a
SQLAlchemy app's settings say) as `postgresql://`, and `postgres://`. One it cannot use (another
driver, another database, no URL at all) raises ValueError when the store is made, with the
fix in the message, and never reaches a request: it used to be taken for an outage, and every
keyed request was answered 503 with Retry-After, which clients retry for ever. What only the
server can refuse (a role that may not log in, a database that is not there) is a 500 that
says so, never a 503. Real uvicorn processes and a real PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from idempotency_asgi import PostgresStore, migrate
from idempotency_asgi.client import AsyncIdempotentTransport, attempts, replayed
from tests import modes
from tests.helpers import assert_problem, effects, fresh_database, headers, new_key
from tests.server import ROOT, UvicornProcess, serve


def with_scheme(url: str, scheme: str, **query: str) -> str:
    parts = urlsplit(url)
    pairs = [*parse_qsl(parts.query, keep_blank_values=True), *query.items()]
    return urlunsplit(parts._replace(scheme=scheme, query=urlencode(pairs)))


REFUSED = [
    ("postgresql+psycopg://app@db/payments", "names the driver 'psycopg'"),
    ("postgresql+psycopg2://app@db/payments", "names the driver 'psycopg2'"),
    ("mysql://app@db/payments", "is for 'mysql' (mysql://), not PostgreSQL"),
    ("sqlite:///payments.db", "is for 'sqlite' (sqlite://), not PostgreSQL"),
    ("host=db dbname=payments password=secret", "a key=value connection string"),
    ("payments", "is not a URL"),
    ("", "is not a URL"),
    # str() of a SQLAlchemy URL: the password hidden.
    ("postgresql+asyncpg://app:***@db/payments", "render_as_string(hide_password=False)"),
    ("postgresql+asyncpg://app@db/payments?ssl=true", "write sslmode="),
    ("postgresql+asyncpg://app@db/payments?command_timeout=5", "command_timeout="),
]


@pytest.mark.parametrize(("url", "said"), REFUSED)
def test_a_url_the_store_cannot_use_is_refused_when_it_is_made(url, said):
    with pytest.raises(ValueError, match="database URL") as refused:
        PostgresStore(url)
    assert said in str(refused.value)  # what is wrong, and what to write instead
    assert "secret" not in str(refused.value)  # a password is never repeated


def test_a_url_object_is_refused_with_how_to_give_its_text():
    from sqlalchemy.engine import make_url

    with pytest.raises(TypeError, match=r"render_as_string\(hide_password=False\)"):
        PostgresStore(make_url("postgresql+asyncpg://app:secret@db/payments"))  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", ["postgresql+asyncpg", "postgres"])
@pytest.mark.parametrize("mode", ["plain", "two-phase", "atomic"])
@modes.own_connections  # the store made from a DSN, not from an application's pool
async def test_the_urls_applications_hold_serve_keyed_requests(schema, db, tenant, scheme, mode):
    # A SQLAlchemy app's URL (`?ssl=` is its asyncpg argument: sslmode for asyncpg's URL): it
    # used to make every keyed request a 503 with Retry-After.
    query = {"ssl": "disable"} if scheme == "postgresql+asyncpg" else {}
    url = with_scheme(schema, scheme, **query)
    path = "/plain/charge" if mode == "plain" else "/tx/charge"
    process = serve(schema, options={"atomic": mode == "atomic"}, STORE_DATABASE_URL=url)
    try:
        key = new_key()
        async with httpx.AsyncClient(base_url=process.url, timeout=10.0) as http:
            first = await http.post(path, json={}, headers=headers(tenant, key))
            again = await http.post(path, json={}, headers=headers(tenant, key))
    finally:
        process.stop()
    assert first.status_code == 201, first.text
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


def _uvicorn(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "app_under_test.py").write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-m", "uvicorn", "app_under_test:app", "--port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_url_for_another_driver_stops_uvicorn_before_it_serves(tmp_path):
    ran = _uvicorn(
        tmp_path,
        """
        from fastapi import FastAPI
        from idempotency_asgi import IdempotencyMiddleware, PostgresStore

        app = FastAPI()
        app.add_middleware(
            IdempotencyMiddleware,
            store=PostgresStore("postgresql+psycopg://app@127.0.0.1:1/payments"),
            tenant=lambda scope: "acme",
        )
        """,
    )
    assert ran.returncode != 0
    assert "names the driver 'psycopg'" in ran.stderr
    assert "Uvicorn running" not in ran.stderr


@pytest.fixture(params=["no-such-database", "cannot-log-in"])
async def refusing(request, schema):
    """The URL of a database that is not there, or of a role the server refuses at login
    (`NOLOGIN`, SQLSTATE 28000: the class a wrong password's 28P01 is in, which a server that
    trusts its socket cannot be made to say)."""
    parts = urlsplit(schema)
    if request.param == "no-such-database":
        yield urlunsplit(parts._replace(path="/no_such_database"))
        return
    role = f"no_login_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(schema)
    try:
        await conn.execute(f"CREATE ROLE {role} NOLOGIN")
        host = parts.netloc.rpartition("@")[2]
        yield urlunsplit(parts._replace(netloc=f"{role}@{host}"))
        await conn.execute(f"DROP ROLE {role}")
    finally:
        await conn.close()


@modes.own_connections
async def test_a_database_that_refuses_the_store_is_a_500_never_retried(
    schema, db, tenant, tmp_path, refusing
):
    url = refusing
    log = tmp_path / "server.log"
    process = UvicornProcess(
        "tests.apps:app",
        {"DATABASE_URL": schema, "STORE_DATABASE_URL": url, "TEST_APP_SERVE": "1"},
        log=log,
    ).start()
    try:
        key = new_key()
        transport = AsyncIdempotentTransport(max_elapsed=10.0, backoff=0.01)
        async with httpx.AsyncClient(
            transport=transport, base_url=process.url, timeout=10.0
        ) as http:
            answer = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        process.stop()
    # Not an outage: no Retry-After, and the library's own client does not retry it.
    assert_problem(answer, 500, "store-refused")
    assert "retry-after" not in answer.headers
    assert attempts(answer) == 1 and not replayed(answer)
    assert await effects(db, tenant, key) == 0  # the handler never ran
    logged = log.read_text()
    assert "key store refused at startup" in logged
    assert "not reachable" not in logged


def run(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    """`python args...` at the repository's root, with DATABASE_URL=dsn."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": dsn},
        capture_output=True,
        text=True,
        timeout=120,
    )


MIGRATE = ("-m", "idempotency_asgi", "migrate")
ALEMBIC = ("-m", "alembic", "upgrade", "head")


async def test_migrate_the_cli_and_alembic_take_the_same_urls(schema):
    async with fresh_database(schema) as fresh:
        assert await migrate(with_scheme(fresh, "postgresql+asyncpg")) != []
        cli = run(*MIGRATE, dsn=with_scheme(fresh, "postgres"))
        assert cli.returncode == 0 and "schema already up to date" in cli.stdout, cli.stderr
        alembic = run(*ALEMBIC, dsn=with_scheme(fresh, "postgresql+asyncpg", ssl="disable"))
        assert alembic.returncode == 0, alembic.stderr
    for command in (MIGRATE, ALEMBIC):
        refused = run(*command, dsn="mysql://app@127.0.0.1:1/payments")
        # Said at once, as what it is: not "database unavailable".
        assert refused.returncode != 0 and "not PostgreSQL" in refused.stderr
        assert "unavailable" not in refused.stderr
    assert run(*MIGRATE, dsn="mysql://app@127.0.0.1:1/payments").returncode == 2  # usage


async def test_the_example_service_runs_on_a_sqlalchemy_url(schema, db):
    # Its settings, its own pool and the store all read DATABASE_URL as a SQLAlchemy app
    # holds it (the example's own pool takes no asyncpg argument in the query: `?ssl=`).
    url = with_scheme(schema, "postgresql+asyncpg")
    process = UvicornProcess("examples.payments.app:app", {"DATABASE_URL": url})
    process.start(ready_path="/healthz")
    try:
        key = new_key()
        sent = {"authorization": "Bearer sk_test_acme", "idempotency-key": key}
        payment = {"amount": 1250, "currency": "EUR", "customer_id": "cus_1"}
        async with httpx.AsyncClient(base_url=process.url, timeout=30) as http:
            first = await http.post("/payments", json=payment, headers=sent)
            again = await http.post("/payments", json=payment, headers=sent)
    finally:
        process.stop()
    assert first.status_code == 201, first.text
    assert again.content == first.content and replayed(again)
    count = "SELECT count(*) FROM payments WHERE idempotency_key = $1"
    assert await db.fetchval(count, key) == 1
