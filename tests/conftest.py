"""A real PostgreSQL for the whole run: $DATABASE_URL when set, else one started here."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from examples.local_postgres import LocalPostgres
from idempotency_asgi import migrate
from tests import batching, citus_cluster, modes
from tests.apps import EFFECTS_DDL
from tests.citus_cluster import citus  # noqa: F401 (the session's Citus cluster, one for all)
from tests.gateway_support import ScriptedUpstream

batching.install()  # IDEMPOTENCY_TEST_BATCHING=forced or off (see tests/batching.py)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if modes.atomic():
        skip = pytest.mark.skip(reason=f"{modes.VARIABLE}=atomic: about the two-phase mode")
        for item in items:
            if "two_phase" in item.keywords:
                item.add_marker(skip)
    if modes.app_pool():
        apart = pytest.mark.skip(
            reason=f"{modes.STORE_VARIABLE}=pool: about the store's own connections"
        )
        for item in items:
            if "own_connections" in item.keywords:
                item.add_marker(apart)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # Without a Citus build every Citus test skips for one reason, and `-ra` gave each test's
    # line its own summary line (about 30). Reported from the one place that decides, they
    # fold into one: its count, where, and the reason.
    report = yield
    if report.skipped and "citus" in item.keywords and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        report.longrepr = (str(Path(citus_cluster.__file__)), None, reason)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if batching.mode():
        shared, statements = batching.sent["shared"], batching.sent["statements"]
        terminalreporter.write_line(
            f"batching {batching.mode()}: {statements} statements sent by this process's"
            f" batchers, {shared} of them carrying two rows or more (the apps served by"
            " uvicorn count in processes of their own; tests/test_batching.py asserts sharing)"
        )


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    configured = os.environ.get("DATABASE_URL")
    if configured:
        yield configured
        return
    server = LocalPostgres.temporary()
    # A run stopped with SIGTERM (a CI timeout, `timeout`, a supervisor) would die without
    # this finally and leave the server running: make it an interruption pytest unwinds.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield server.start()
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
async def schema(database_url: str) -> str:
    await migrate(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(EFFECTS_DDL)
    finally:
        await conn.close()
    return database_url


@pytest.fixture(scope="session")
async def db(schema: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool for the tests' own audits, separate from anything under test."""
    pool = await asyncpg.create_pool(schema, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture
def tenant() -> str:
    # A tenant of its own per test: tests never see each other's keys or effects.
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def scripted_upstream() -> Iterator[ScriptedUpstream]:
    """An upstream on a bare socket whose answers a gateway test scripts (tests/gateway_support)."""
    scripted = ScriptedUpstream().start()
    yield scripted
    scripted.stop()
