"""What a service says and does when it starts: maintenance begins after the application's own
startup (which may migrate), and a missing schema is said once, loudly, with the fix."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import httpx

from idempotency_asgi import PostgresStore, migrate
from tests.apps import build_app
from tests.helpers import assert_problem, client, fresh_database, headers
from tests.server import UvicornProcess


async def test_the_example_on_a_fresh_database_migrates_before_maintenance_runs(schema, tmp_path):
    log = tmp_path / "uvicorn.log"
    async with fresh_database(schema) as url:
        server = UvicornProcess("examples.payments.app:app", {"DATABASE_URL": url}, log=log).start(
            ready_path="/healthz"
        )
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                response = await http.post(
                    "/payments",
                    json={"amount": 100, "currency": "EUR", "customer_id": "c"},
                    headers={"authorization": "Bearer sk_test_acme", "idempotency-key": "k"},
                )
            await asyncio.sleep(1.0)  # the reaper and the sweeper run a batch at once
        finally:
            server.stop()
    output = log.read_text()
    assert response.status_code == 201
    assert "does not exist" not in output, output
    assert "maintenance batch failed" not in output, output


async def test_a_missing_schema_is_said_once_at_startup_with_the_command(schema, tenant, caplog):
    async with fresh_database(schema) as url:  # no migrations applied
        app = build_app(url, store=PostgresStore(url))
        with caplog.at_level(logging.INFO, logger="idempotency_asgi"):
            async with client(app) as http:
                startup = [r for r in caplog.records if r.levelno >= logging.ERROR]
                first = await http.post("/plain/charge", json={}, headers=headers(tenant, "a"))
                second = await http.post("/plain/charge", json={}, headers=headers(tenant, "b"))
    [said] = startup
    assert "idempotency-asgi migrate" in said.getMessage()
    assert "503" in said.getMessage()
    for response in (first, second):
        assert_problem(response, 503, "store-unavailable")
    # Each failed request's own line names the cause too, not just an error class.
    lines = [r.getMessage() for r in caplog.records if hasattr(r, "idempotency")]
    assert len(lines) == 2 and all("idempotency-asgi migrate" in line for line in lines)


async def test_an_older_schema_is_reported_at_startup(schema, tenant, caplog):
    async with fresh_database(schema) as url:
        await migrate(url)
        conn = await asyncpg.connect(url)
        await conn.execute("UPDATE idempotency_asgi_version SET version_num = '0001'")
        await conn.close()
        app = build_app(url, store=PostgresStore(url))
        with caplog.at_level(logging.WARNING, logger="idempotency_asgi"):
            async with client(app) as http:
                await http.get("/read")
    assert any("revision '0001'" in r.getMessage() for r in caplog.records)
