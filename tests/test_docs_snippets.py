"""The documentation's code is real: every Python block in docs/ and the README is a copy of a
file (scripts/doc_code.py keeps it equal), and each file runs here, its application driven over
`httpx.ASGITransport` against the suite's PostgreSQL. The pages hold the code itself, so that
GitHub shows it as the site does."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import re
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore, migrate
from tests.helpers import assert_problem, client, eventually, fresh_database, lifespan, new_key

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"

#: The tables the snippets' handlers write to, in a database of their own.
SNIPPET_TABLES = """
CREATE TABLE payments (id text PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL);
CREATE TABLE customers (email text PRIMARY KEY);
CREATE TABLE charges (reference text PRIMARY KEY, amount bigint NOT NULL);
"""

ACME = {"authorization": "Bearer sk_test_acme"}

#: Each snippet file, and the test below that runs it.
TESTED = {
    "quickstart.py": "test_quickstart_runs_an_order_once_and_replays_it",
    "transactional.py": "test_transactional_commits_the_payment_with_its_record",
    "atomic.py": "test_atomic_commits_the_payment_its_event_and_its_record_once",
    "every_option.py": "test_every_option_lists_each_option_at_its_default",
    "config_object.py": "test_a_config_object_makes_a_fingerprinted_header_part_of_the_request",
    "starlette_app.py": "test_starlette_endpoint_writes_in_the_request_transaction",
    "mounted.py": "test_a_mounted_app_matches_paths_as_it_routes_them",
    "openapi_cors.py": "test_openapi_documents_the_header_and_cors_exposes_the_replay_headers",
    "maintenance_app.py": "test_background_maintenance_reaps_an_expired_key",
    "transactional_errors.py": "test_a_caught_error_is_recorded_and_an_unknown_outcome_held",
    "ha_store.py": "test_a_store_given_several_hosts_uses_the_one_that_answers",
    "consumer.py": "test_the_consumer_books_a_message_once",
    "gateway_app.py": "test_the_gateway_snippet_lists_its_defaults_and_replays",
    "verify_staging.py": "test_verify_from_code_passes_the_transactional_example",
    "sqlalchemy_app.py": "test_the_sqlalchemy_app_commits_a_payment_and_its_event_with_the_record",
    "sqlmodel_app.py": "test_the_sqlmodel_app_makes_a_hero_once_through_its_typed_session",
    "alembic_env.py": "test_a_teams_alembic_project_leaves_the_librarys_tables_alone",
    "alembic_revision.py": "test_a_teams_alembic_project_leaves_the_librarys_tables_alone",
    "client_usage.py": "test_the_client_pays_an_order_once_though_its_first_answer_is_lost",
    "fastapi_tenants.py": "test_the_tenant_is_what_authentication_found_for_both",
    "after_commit.py": "test_after_commit_sends_one_receipt_for_a_payment_that_committed",
    "sqlalchemy_migrating.py": "test_a_migrated_app_writes_through_the_request_session_only",
}


@pytest.fixture(scope="module")
async def snippet_db(schema: str) -> AsyncIterator[str]:
    """A database of the snippets' own: their tables are called what a reader's would be."""
    async with fresh_database(schema) as dsn:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(SNIPPET_TABLES)
        finally:
            await conn.close()
        yield dsn


@pytest.fixture
def env(snippet_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("DATABASE_URL", snippet_db)
    yield monkeypatch


def load(name: str) -> ModuleType:
    """Import a snippet afresh (it reads its environment when imported)."""
    module_name = f"docs_snippet_{Path(name).stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, SNIPPETS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


async def count(dsn: str, sql: str, *args: Any) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql, *args))
    finally:
        await conn.close()


# -- the documentation holds no code of its own -----------------------------------------------


def test_every_snippet_file_is_run_by_a_test():
    assert {path.name for path in SNIPPETS.glob("*.py")} == set(TESTED)
    here = sys.modules[__name__]
    for test in TESTED.values():
        assert callable(getattr(here, test, None)), test


FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
CODE_MARKER = re.compile(r"^ *<!-- code: [^>]+ -->\n( *)```", re.MULTILINE)


def doc_code() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_code", ROOT / "scripts" / "doc_code.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_python_block_is_a_copy_of_a_file():
    for page in pages():
        text = page.read_text()
        marked = {match.end() for match in CODE_MARKER.finditer(text)}
        for block in FENCE.finditer(text):
            if block.group(2) in ("python", "py", "pycon"):
                assert block.start(2) in marked, (
                    f"{page.name}: Python written in the page, not a copy of a tested file"
                    f" (<!-- code: docs/snippets/NAME.py --> above it): {block.group(3)[:80]!r}"
                )


def test_the_copies_equal_their_files():
    assert doc_code().differences(write=False) == [], "run scripts/doc-code"


def test_the_pages_include_nothing():
    # An include is a marker GitHub shows instead of the code.
    for page in pages():
        assert "--8<--" not in page.read_text(), page.name


def test_the_readme_shows_the_quickstart():
    assert "<!-- code: docs/snippets/quickstart.py -->" in (ROOT / "README.md").read_text()


# -- each snippet, run ------------------------------------------------------------------------


async def test_quickstart_runs_an_order_once_and_replays_it(env):
    app = load("quickstart.py").app
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/orders", json={"sku-1": 2}, headers={**ACME, "idempotency-key": key}
        )
        retry = await http.post(
            "/orders", json={"sku-1": 2}, headers={**ACME, "idempotency-key": key}
        )
        stranger = await http.post("/orders", json={"sku-1": 2}, headers={"idempotency-key": key})
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert_problem(stranger, 401, "unauthenticated")


async def test_transactional_commits_the_payment_with_its_record(env, snippet_db):
    app = load("transactional.py").app
    key = new_key()
    payment = {"amount": 1250, "currency": "EUR"}
    async with client(app) as http:
        first = await http.post("/payments", json=payment, headers={**ACME, "idempotency-key": key})
        retry = await http.post("/payments", json=payment, headers={**ACME, "idempotency-key": key})
    assert first.status_code == 201, first.text
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    made = first.json()["id"]
    assert await count(snippet_db, "SELECT count(*) FROM payments WHERE id = $1", made) == 1


async def test_atomic_commits_the_payment_its_event_and_its_record_once(env, snippet_db):
    app = load("atomic.py").app
    key = new_key()
    payment = {"amount": 1250, "currency": "EUR"}
    async with client(app) as http:
        first = await http.post("/payments", json=payment, headers={**ACME, "idempotency-key": key})
        retry = await http.post("/payments", json=payment, headers={**ACME, "idempotency-key": key})
    assert first.status_code == 201, first.text
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    made = first.json()["id"]
    assert await count(snippet_db, "SELECT count(*) FROM payments WHERE id = $1", made) == 1
    events = "SELECT count(*) FROM outbox WHERE event->>'id' = $1"
    assert await count(snippet_db, events, made) == 1


async def test_after_commit_sends_one_receipt_for_a_payment_that_committed(env, snippet_db):
    module = load("after_commit.py")
    key, declined = new_key(), new_key()
    payment = {"amount": 1250, "currency": "EUR"}
    async with client(module.app) as http:
        first = await http.post("/payments", json=payment, headers={**ACME, "idempotency-key": key})
        retry = await http.post("/payments", json=payment, headers={**ACME, "idempotency-key": key})
        big = {"amount": 2_000_000, "currency": "EUR"}
        for _ in range(2):
            failed = await http.post(
                "/payments", json=big, headers={**ACME, "idempotency-key": declined}
            )
            assert failed.status_code == 502
    assert first.status_code == 201, first.text
    assert retry.headers["idempotent-replayed"] == "true"
    assert module.receipts == [first.json()["id"]]  # once, and none for the declined ones


async def test_a_migrated_app_writes_through_the_request_session_only(schema, monkeypatch):
    async with fresh_database(schema) as dsn:
        await migrate(dsn)
        monkeypatch.setenv("DATABASE_URL", dsn)
        module = load("sqlalchemy_migrating.py")
        await create_tables(dsn, module.Base.metadata)
        key = new_key()
        payment = {"amount": 1250, "currency": "EUR"}
        try:
            async with client(module.app) as http:
                first = await http.post(
                    "/payments", json=payment, headers={**ACME, "idempotency-key": key}
                )
                retry = await http.post(
                    "/payments", json=payment, headers={**ACME, "idempotency-key": key}
                )
                read = await http.get(f"/payments/{first.json()['id']}")
        finally:
            await module.engine.dispose()
        assert first.status_code == 201, first.text
        assert retry.content == first.content
        assert read.json() == first.json()  # the application's own session sees it, committed
        made = first.json()["id"]
        assert await count(dsn, "SELECT count(*) FROM payments WHERE id = $1", made) == 1


def middleware_options(app: Any) -> dict[str, Any]:
    [entry] = [m for m in app.user_middleware if m.cls is IdempotencyMiddleware]
    return dict(entry.kwargs)


async def test_every_option_lists_each_option_at_its_default(env):
    app = load("every_option.py").app
    options = middleware_options(app)
    declared = {option.name for option in fields(IdempotencyConfig)}
    assert set(options) == declared | {"store", "tenant", "maintenance"}
    # The page says these are the defaults: they are.
    assert IdempotencyConfig(**{name: options[name] for name in declared}) == IdempotencyConfig()
    assert options["maintenance"] is None
    headers = {**ACME, "idempotency-key": new_key()}
    async with client(app) as http:
        first = await http.post("/payments", json={"amount": 1}, headers=headers)
        retry = await http.post("/payments", json={"amount": 1}, headers=headers)
    assert first.status_code == 201 and retry.headers["idempotent-replayed"] == "true"


async def test_a_config_object_makes_a_fingerprinted_header_part_of_the_request(env):
    module = load("config_object.py")
    assert module.CONFIG.wait_seconds == 5.0
    key = new_key()
    v1 = {**ACME, "idempotency-key": key, "x-api-version": "1"}
    async with client(module.app) as http:
        first = await http.post("/reports", headers=v1)
        retry = await http.post("/reports", headers=v1)
        other = await http.post("/reports", headers={**v1, "x-api-version": "2"})
    assert first.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert_problem(other, 422, "key-reused")


async def test_starlette_endpoint_writes_in_the_request_transaction(env, snippet_db):
    app = load("starlette_app.py").app
    headers = {**ACME, "idempotency-key": new_key()}
    async with client(app) as http:
        first = await http.post("/payments", json={"amount": 5, "currency": "USD"}, headers=headers)
        retry = await http.post("/payments", json={"amount": 5, "currency": "USD"}, headers=headers)
    assert first.status_code == 201, first.text
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    made = first.json()["id"]
    assert await count(snippet_db, "SELECT count(*) FROM payments WHERE id = $1", made) == 1


async def test_a_mounted_app_matches_paths_as_it_routes_them(env):
    module = load("mounted.py")
    headers = {**ACME, "idempotency-key": new_key()}
    async with client(module.app) as http:
        payment = [await http.post("/v1/payments", content=b"a", headers=headers) for _ in "12"]
        hook = [await http.post("/v1/webhooks/psp", content=b"b", headers=headers) for _ in "12"]
    assert payment[1].headers["idempotent-replayed"] == "true"
    # Exempt as the mounted app routes it: never touched, even with a key.
    assert [r.status_code for r in hook] == [200, 200]
    assert not any("idempotent-replayed" in r.headers for r in hook)
    assert hook[0].json()["path"] == "/v1/webhooks/psp"


async def test_openapi_documents_the_header_and_cors_exposes_the_replay_headers(env):
    app = load("openapi_cors.py").app
    origin = {"origin": "https://app.example.com"}
    headers = {**origin, **ACME, "idempotency-key": new_key()}
    async with client(app) as http:
        spec = (await http.get("/openapi.json")).json()
        first = await http.post("/payments", json={"amount": 3, "currency": "EUR"}, headers=headers)
        retry = await http.post("/payments", json={"amount": 3, "currency": "EUR"}, headers=headers)
    operation = spec["paths"]["/payments"]["post"]
    assert "Idempotency-Key" in [p["name"] for p in operation["parameters"]]
    assert {"201", "409", "422", "503"} <= set(operation["responses"])
    assert first.status_code == 201, first.text
    assert retry.headers["idempotent-replayed"] == "true"
    exposed = retry.headers["access-control-expose-headers"].lower()
    assert "idempotent-replayed" in exposed and "retry-after" in exposed


async def test_background_maintenance_reaps_an_expired_key(env, snippet_db):
    key = new_key()
    async with client(load("quickstart.py").app) as http:
        made = await http.post("/orders", json={}, headers={**ACME, "idempotency-key": key})
    assert made.status_code == 201
    sql = "SELECT count(*) FROM idempotency_keys WHERE tenant_id = 'acme' AND idempotency_key = $1"
    conn = await asyncpg.connect(snippet_db)
    try:
        # Past its retention, as a day later.
        await conn.execute(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
            " WHERE tenant_id = 'acme' AND idempotency_key = $1",
            key,
        )
        assert await conn.fetchval(sql, key) == 1

        async def reaped() -> bool:
            return bool(await conn.fetchval(sql, key) == 0)

        async with lifespan(load("maintenance_app.py").app):  # a runner is elected and reaps
            await eventually(reaped, timeout=15)
    finally:
        await conn.close()


async def test_a_caught_error_is_recorded_and_an_unknown_outcome_held(env, snippet_db):
    module = load("transactional_errors.py")
    email = f"{uuid.uuid4().hex[:8]}@example.com"
    taken = {**ACME, "idempotency-key": new_key()}
    async with client(module.app) as http:
        made = await http.post(
            "/customers",
            json={"email": email},
            headers={**ACME, "idempotency-key": new_key()},
        )
        refused = await http.post("/customers", json={"email": email}, headers=taken)
        again = await http.post("/customers", json={"email": email}, headers=taken)
        charged = await http.post(
            "/charges",
            json={"amount": 700},
            headers={**ACME, "idempotency-key": new_key()},
        )

        async def silent(amount: int) -> str:
            await asyncio.sleep(10)
            return "never"

        module.charge_card = silent
        module.CARD_NETWORK_TIMEOUT = 0.05
        unknown = {**ACME, "idempotency-key": new_key()}
        lost = await http.post("/charges", json={"amount": 800}, headers=unknown)
        held = await http.post("/charges", json={"amount": 800}, headers=unknown)
    assert made.status_code == 201
    assert refused.status_code == 409 and "idempotent-replayed" not in refused.headers
    assert again.status_code == 409 and again.headers["idempotent-replayed"] == "true"
    assert charged.status_code == 201
    assert_problem(lost, 504, "outcome-unknown")
    assert_problem(held, 409, "request-in-progress")  # nothing runs until the lease lapses
    sql = "SELECT count(*) FROM charges WHERE amount = 800"
    assert await count(snippet_db, sql) == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_store_given_several_hosts_uses_the_one_that_answers(snippet_db):
    assert isinstance(load("ha_store.py").store, PostgresStore)
    # The same list of hosts, the first one down: the store connects to the second.
    real = urlsplit(snippet_db)
    conn = await asyncpg.connect(snippet_db)
    try:
        port = await conn.fetchval("SHOW port")
    finally:
        await conn.close()
    host = dict(parse_qsl(real.query)).get("host") or real.hostname
    query = urlencode({"host": f"127.0.0.1,{host}", "port": f"{free_port()},{port}"}, safe=",/")
    user = real.netloc.rpartition("@")[0]
    dsn = urlunsplit(
        real._replace(netloc=f"{user}@", query=query + "&target_session_attrs=read-write")
    )
    store = PostgresStore(dsn)
    try:
        assert await store.schema_revision() is not None
    finally:
        await store.close()


async def test_the_consumer_books_a_message_once(snippet_db):
    module = load("consumer.py")
    message = f"msg_{uuid.uuid4().hex}"
    pool = await asyncpg.create_pool(snippet_db, min_size=1, max_size=2)
    try:
        first = await module.handle_charge(pool, message, 1500)
        again = await module.handle_charge(pool, message, 1500)
    finally:
        await pool.close()
    assert first.first and not again.first
    assert again.result == first.result == f'{{"charge_id": "{message}"}}'.encode()
    sql = "SELECT count(*) FROM charges WHERE reference = $1"
    assert await count(snippet_db, sql, message) == 1


async def test_the_gateway_snippet_lists_its_defaults_and_replays(env, scripted_upstream):
    from idempotency_asgi.gateway import build_gateway

    source = (SNIPPETS / "gateway_app.py").read_text()
    [call] = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "build_gateway"
    ]
    parameters = inspect.signature(build_gateway).parameters
    gateway_config = parameters["config"].default
    listed = {keyword.arg: keyword.value for keyword in call.keywords}
    for name in parameters:
        if name in ("upstream", "store", "tenant", "config", "transport", "options"):
            continue
        assert name in listed, f"gateway_app.py does not list {name}"
    for name, node in listed.items():
        if name in ("store", "tenant"):
            continue
        # Literals, and products such as 32 * 1024.
        value = eval(compile(ast.Expression(node), "gateway_app.py", "eval"), {})
        config_field = name in {option.name for option in fields(IdempotencyConfig)}
        default = getattr(gateway_config, name) if config_field else parameters[name].default
        assert value == default, f"gateway_app.py says {name}={value!r}; it is {default!r}"

    env.setenv("UPSTREAM_URL", scripted_upstream.url)
    app = load("gateway_app.py").app
    key = new_key()
    headers = {"x-consumer-id": "acme", "idempotency-key": key}
    async with client(app) as http:
        first = await http.post("/orders", content=b'{"n": 1}', headers=headers)
        retry = await http.post("/orders", content=b'{"n": 1}', headers=headers)
    assert first.status_code == 200, first.text
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    sent = [
        r for r in scripted_upstream.requests if (b"idempotency-key", key.encode()) in r.headers
    ]
    assert len(sent) == 1


async def test_verify_from_code_passes_the_transactional_example(env):
    env.setenv("STAGING_URL", "http://staging.test/payments")
    env.setenv("STAGING_TOKEN", "sk_test_acme")
    app = load("transactional.py").app
    script = load("verify_staging.py")
    async with lifespan(app):
        exit_status = await script.main(httpx.ASGITransport(app=app))
    assert exit_status == 0


async def create_tables(dsn: str, metadata: Any) -> None:
    """An application's tables from its metadata, as its own migrations would make them."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    finally:
        await engine.dispose()


async def test_the_sqlalchemy_app_commits_a_payment_and_its_event_with_the_record(
    schema, monkeypatch
):
    async with fresh_database(schema) as dsn:
        await migrate(dsn)
        monkeypatch.setenv("DATABASE_URL", dsn)
        module = load("sqlalchemy_app.py")
        await create_tables(dsn, module.Base.metadata)
        key = new_key()
        payment = {"amount": 1250, "currency": "EUR"}
        async with client(module.app) as http:
            first = await http.post(
                "/payments", json=payment, headers={**ACME, "idempotency-key": key}
            )
            retry = await http.post(
                "/payments", json=payment, headers={**ACME, "idempotency-key": key}
            )
        assert first.status_code == 201, first.text
        assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
        made = first.json()["id"]
        assert first.json()["created_at"]  # read back after the commit (a server default)
        assert await count(dsn, "SELECT count(*) FROM payments WHERE id = $1", made) == 1
        events = "SELECT count(*) FROM outbox WHERE event->>'id' = $1"
        assert await count(dsn, events, made) == 1


async def test_the_sqlmodel_app_makes_a_hero_once_through_its_typed_session(schema, monkeypatch):
    import idempotency_asgi.sqlalchemy

    async with fresh_database(schema) as dsn:
        await migrate(dsn)
        monkeypatch.setenv("DATABASE_URL", dsn)
        try:
            module = load("sqlmodel_app.py")
            scope = {"type": "http", "method": "POST", "path": "/", "headers": CLIENT_HEADERS}
            assert module.tenant(scope) is None  # a client's own header names nobody
            await create_tables(dsn, module.SQLModel.metadata)
            hero = {"name": "Deadpond", "secret_name": "Dive Wilson"}
            key = new_key()
            async with client(module.app) as http:
                first = await http.post(
                    "/heroes", json=hero, headers={**ACME, "idempotency-key": key}
                )
                retry = await http.post(
                    "/heroes", json=hero, headers={**ACME, "idempotency-key": key}
                )
                taken = await http.post(
                    "/heroes", json=hero, headers={**ACME, "idempotency-key": new_key()}
                )
        finally:
            idempotency_asgi.sqlalchemy.configure()  # the default again, for the other tests
        assert first.status_code == 201, first.text
        assert first.json()["id"] is not None
        assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
        assert taken.status_code == 409  # session.exec(), SQLModel's own, found it
        assert await count(dsn, "SELECT count(*) FROM hero") == 1


async def test_a_teams_alembic_project_leaves_the_librarys_tables_alone(schema, tmp_path):
    from tests.alembic_project import SNIPPETS, Project, operations

    async with fresh_database(schema) as dsn:
        project = Project(tmp_path, dsn)
        # The team's first revision: its own tables, from its models.
        first = project.autogenerate("0001", "payments")
        assert "op.create_table('payments'" in first and "op.create_table('outbox'" in first
        # The library's tables from a revision of the team's, as the page shows.
        project.add_revision("0002_idempotency.py", (SNIPPETS / "alembic_revision.py").read_text())
        project.run("upgrade", "head")
        assert await migrate(dsn) == []  # applied by the revision, in the library's version table
        tables = "SELECT count(*) FROM pg_tables WHERE tablename = ANY($1::text[])"
        names = ["idempotency_keys", "idempotency_leases", "payments", "outbox"]
        assert await count(dsn, tables, names) == 4
        # Autogenerate again, against a database holding both: nothing to do.
        again = project.autogenerate("0003", "nothing")
        assert operations(again) == [], again
        # Without the two lines, it would drop the library's tables: the check can fail.
        source = (SNIPPETS / "alembic_env.py").read_text()
        bare = "\n".join(line for line in source.splitlines() if "include_" not in line)
        careless = Project(tmp_path / "careless", dsn, env_source=bare)
        for path in project.versions.glob("000[12]_*.py"):
            careless.add_revision(path.name, path.read_text())
        proposed = careless.autogenerate("0003", "careless")
        assert "op.drop_table('idempotency_keys')" in proposed, proposed
        assert operations(proposed)


class LosesFirstAnswer(httpx.AsyncBaseTransport):
    """Sends every request; the first one's answer is lost on the way back."""

    def __init__(self, sending: httpx.AsyncBaseTransport) -> None:
        self.sending = sending
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.sending.handle_async_request(request)
        self.sent += 1
        if self.sent == 1:
            await response.aread()
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return response


async def test_the_client_pays_an_order_once_though_its_first_answer_is_lost(env, snippet_db):
    app = load("transactional.py").app
    module = load("client_usage.py")
    order = uuid.uuid4().hex[:12]
    async with lifespan(app):
        sending = LosesFirstAnswer(httpx.ASGITransport(app=app))
        async with module.payments_client(sending) as http:
            paid = await module.pay(http, order, 1250)
            again = await module.pay(http, order, 1250)  # the same order, later: its key
    assert sending.sent == 3  # the lost answer, its retry (the replay), the later call
    assert again == paid
    sql = "SELECT count(*) FROM payments WHERE id = $1"
    assert await count(snippet_db, sql, paid["id"]) == 1


async def test_the_tenant_is_what_authentication_found_for_both(env, snippet_db):
    module = load("fastapi_tenants.py")
    key = new_key()
    order = {"sku-1": 2}
    globex = {"authorization": "Bearer sk_test_globex"}
    async with client(module.app) as http:
        first = await http.post("/orders", json=order, headers={**ACME, "idempotency-key": key})
        retry = await http.post("/orders", json=order, headers={**ACME, "idempotency-key": key})
        # The same key from another account: its own request, never acme's replay.
        other = await http.post("/orders", json=order, headers={**globex, "idempotency-key": key})
        # A header any client can send names nobody: without a credential, 401.
        claimed = await http.post(
            "/orders", json=order, headers={"x-account-id": "acme", "idempotency-key": key}
        )
    assert first.status_code == 201 and first.json()["account"] == "acme"
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    assert other.status_code == 201 and other.json()["account"] == "globex"
    assert "idempotent-replayed" not in other.headers
    assert_problem(claimed, 401, "unauthenticated")
    assert claimed.headers["www-authenticate"] == "Bearer"


async def test_added_in_the_wrong_order_the_resolver_finds_nobody_and_refuses(env):
    # Starlette runs the middleware added last first. Added before IdempotencyMiddleware,
    # authentication runs after it: the resolver finds no user, and every keyed request is
    # refused (401), never run under a guessed tenant.
    from starlette.middleware.authentication import AuthenticationMiddleware

    module = load("fastapi_tenants.py")
    app = module.app
    app.user_middleware.reverse()
    assert app.user_middleware[-1].cls is AuthenticationMiddleware  # now the innermost
    async with client(app) as http:
        keyed = await http.post("/orders", json={}, headers={**ACME, "idempotency-key": new_key()})
    assert_problem(keyed, 401, "unauthenticated")


#: Headers a client sets as it likes: none of them is authentication.
CLIENT_HEADERS = [
    (b"x-account-id", b"acme"),
    (b"x-tenant", b"acme"),
    (b"x-tenant-id", b"acme"),
    (b"x-user-id", b"acme"),
    (b"x-customer-id", b"acme"),
]


async def test_no_snippet_takes_the_tenant_from_a_header_any_client_can_send(env):
    # Copied as it is, a resolver that trusts such a header lets any client read any
    # tenant's replays, or claim its keys first. The gateway's snippet reads a header that
    # the authenticating proxy in front of it sets (and strips from clients): its page says so.
    scope = {"type": "http", "method": "POST", "path": "/", "headers": CLIENT_HEADERS}
    checked = 0
    for path in sorted(SNIPPETS.glob("*.py")):
        if path.name == "gateway_app.py" or path.name.startswith("alembic_"):
            continue  # (an Alembic project's files import its own model: no tenant in them)
        if path.name == "sqlmodel_app.py":
            continue  # SQLModel keeps its tables for the process: checked in its own test
        resolver = getattr(load(path.name), "tenant", None)
        if resolver is None:
            continue
        found = resolver(dict(scope))
        if inspect.isawaitable(found):
            found = await found
        assert found is None, f"{path.name}: tenant() believes a client's own header"
        checked += 1
    assert checked >= 10


async def test_the_atomic_mode_page_shows_a_whole_file_that_runs(env, snippet_db, tmp_path):
    # Copied from the page as it is (not from the snippet), the file runs: its imports, its
    # tenant, its model and its tables are all there.
    page = (DOCS / "transactional.md").read_text()
    found = re.search(
        r"<!-- code: docs/snippets/atomic\.py -->\n```python[^\n]*\n(.*?)^```", page, re.S | re.M
    )
    assert found, "transactional.md shows atomic.py whole, not a part of it"
    (tmp_path / "atomic_from_the_page.py").write_text(found.group(1))
    spec = importlib.util.spec_from_file_location(
        "atomic_from_the_page", tmp_path / "atomic_from_the_page.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    headers = {**ACME, "idempotency-key": new_key()}
    payment = {"amount": 990, "currency": "EUR"}
    async with client(module.app) as http:
        first = await http.post("/payments", json=payment, headers=headers)
        retry = await http.post("/payments", json=payment, headers=headers)
    assert first.status_code == 201, first.text
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    # ...and the page links the file it names.
    assert "blob/main/docs/snippets/atomic.py" in page
