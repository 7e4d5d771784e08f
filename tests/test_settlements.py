"""The settlement table is the contract: every case in it is brought about here over HTTP, on
real PostgreSQL, and checked against its own row: the answer, what became of the key, the
outcome reported and the level it was logged at. The contract page's table (docs/contract.md)
is that table."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from idempotency_asgi import PostgresStore
from idempotency_asgi._asgi.settlement import Fate, Settlement, markdown_table
from idempotency_asgi._asgi.telemetry import key_hash
from idempotency_asgi._postgres.keyhash import key_lock
from tests import modes
from tests.apps import build_app
from tests.helpers import (
    assert_problem,
    claimed,
    client,
    effects,
    eventually,
    headers,
    key_row,
    new_key,
    running,
)

CONTRACT = Path(__file__).resolve().parent.parent / "docs" / "contract.md"


@dataclass
class Run:
    """One scenario: its final request's answer, and the key it was about."""

    schema: str
    db: asyncpg.Pool
    tenant: str
    caplog: pytest.LogCaptureFixture
    read_only_dsn: str
    key: str = field(default_factory=new_key)
    before: asyncpg.Record | None = None
    sealed: list[logging.LogRecord] | None = None
    after: asyncpg.Record | None = None

    def mark(self) -> None:
        """From here on: what the final request reports."""
        self.caplog.clear()

    async def seal(self) -> None:
        """Up to here: the final request has answered, while another is still running."""
        self.sealed = list(self.caplog.records)
        self.after = await key_row(self.db, self.tenant, self.key)

    def lines(self) -> list[logging.LogRecord]:
        records = self.caplog.records if self.sealed is None else self.sealed
        return [r for r in records if hasattr(r, "idempotency")]


Scenario = Callable[[Run], Awaitable[httpx.Response]]

#: Cases only the two-phase mode has, as their scenarios bring them about (the suite runs
#: again with /tx/ routes in the atomic mode: see tests/modes.py).
TWO_PHASE_ONLY = {
    Settlement.LEASE_LOST: "no lease to lose: the transaction is the lease",
    Settlement.STORE_REFUSED: "the read-only role refuses the handler's own write first",
}
SCENARIOS: dict[Settlement, Scenario] = {}


def scenario(settlement: Settlement) -> Callable[[Scenario], Scenario]:
    def register(function: Scenario) -> Scenario:
        SCENARIOS[settlement] = function
        return function

    return register


async def _post(http: httpx.AsyncClient, run: Run, path: str = "/tx/charge", **extra: str):
    return await http.post(path, json={}, headers=headers(run.tenant, run.key, **extra))


@scenario(Settlement.UNAUTHENTICATED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await http.post("/tx/charge", json={}, headers=headers(None, run.key))


@scenario(Settlement.TENANT_FAILED)
async def _(run: Run) -> httpx.Response:
    def resolver(scope: object) -> str:
        raise RuntimeError("the token service is down")

    async with client(build_app(run.schema, tenant=resolver)) as http:
        run.mark()
        return await _post(http, run)


@scenario(Settlement.MISSING_KEY)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await http.post("/tx/charge", json={}, headers=headers(run.tenant))


@scenario(Settlement.INVALID_KEY)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await http.post("/tx/charge", json={}, headers=headers(run.tenant, "two words"))


@scenario(Settlement.BODY_TOO_LARGE)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, max_body_bytes=10)) as http:
        run.mark()
        return await http.post(
            "/tx/charge", json={"x": "y" * 20}, headers=headers(run.tenant, run.key)
        )


@scenario(Settlement.STORE_UNAVAILABLE)
async def _(run: Run) -> httpx.Response:
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/postgres", timeout=0.5)
    async with client(build_app(run.schema, store=store)) as http:
        run.mark()
        return await _post(http, run)


@scenario(Settlement.STORE_REFUSED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, store=PostgresStore(run.read_only_dsn))) as http:
        run.mark()
        return await _post(http, run)


@scenario(Settlement.NEW)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await _post(http, run)


@scenario(Settlement.EXPIRED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, ttl_seconds=0.5)) as http:
        await _post(http, run)
        await asyncio.sleep(0.7)
        run.mark()
        return await _post(http, run)


@scenario(Settlement.REPLAYED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        await _post(http, run)
        run.before = await key_row(run.db, run.tenant, run.key)
        run.mark()
        return await _post(http, run)


@scenario(Settlement.MISMATCH)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        await _post(http, run)
        run.before = await key_row(run.db, run.tenant, run.key)
        run.mark()
        return await http.post("/tx/other", json={}, headers=headers(run.tenant, run.key))


@scenario(Settlement.IN_FLIGHT)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        first = asyncio.create_task(_post(http, run, x_delay_ms="800"))
        await running(run.db, run.tenant, run.key)
        run.before = await key_row(run.db, run.tenant, run.key)  # none yet, when atomic
        run.mark()
        duplicate = await _post(http, run)
        await run.seal()
        await first
        return duplicate


@scenario(Settlement.OVER_LIMIT)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, max_in_flight_per_tenant=1)) as http:
        other = new_key()
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(run.tenant, other, x_delay_ms="800"))
        )
        await running(run.db, run.tenant, other)
        run.mark()
        refused = await _post(http, run)
        await run.seal()
        await slow
        return refused


@scenario(Settlement.OVER_QUOTA)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, max_keys_per_tenant=1)) as http:
        await http.post("/tx/charge", json={}, headers=headers(run.tenant, new_key()))
        await asyncio.sleep(1.1)  # past what a process takes as the tenant's count
        run.mark()
        return await _post(http, run)


@scenario(Settlement.NOT_REPLAYABLE)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, max_stored_response_bytes=10)) as http:
        await http.post("/big?size=100", headers=headers(run.tenant, run.key))
        run.before = await key_row(run.db, run.tenant, run.key)
        run.mark()
        return await http.post("/big?size=100", headers=headers(run.tenant, run.key))


@scenario(Settlement.OMITTED_REPLAY)
async def _(run: Run) -> httpx.Response:
    app = build_app(
        run.schema, max_stored_response_bytes=10, omitted_replay_header="Idempotency-Replay"
    )
    async with client(app) as http:
        await http.post("/big?size=100", headers=headers(run.tenant, run.key))
        run.before = await key_row(run.db, run.tenant, run.key)
        run.mark()
        response = await http.post("/big?size=100", headers=headers(run.tenant, run.key))
    assert response.status_code == 201 and response.content == b""
    assert response.headers["idempotency-replay"] == "omitted"
    assert response.headers["idempotent-replayed"] == "true"
    return response


@scenario(Settlement.UNREADABLE)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        await _post(http, run)
        await run.db.execute(
            "UPDATE idempotency_keys SET format_version = 99"
            " WHERE tenant_id = $1 AND idempotency_key = $2",
            run.tenant,
            run.key,
        )
        run.before = await key_row(run.db, run.tenant, run.key)
        run.mark()
        return await _post(http, run)


@scenario(Settlement.TAKEN_OVER)
async def _(run: Run) -> httpx.Response:
    # Its owner died: it stopped renewing (an "outcome unknown" leaves the key so), and the
    # lease of half a second lapsed.
    async with client(build_app(run.schema, lease_seconds=0.5)) as http:
        await _post(http, run, x_unknown="1")
        await asyncio.sleep(0.7)
        run.mark()
        return await _post(http, run)


@scenario(Settlement.RELEASED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await _post(http, run, x_status="503")


@scenario(Settlement.OUTCOME_UNKNOWN)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await http.post(
            "/fan-out", content=b"{}", headers=headers(run.tenant, run.key, x_group="unknown")
        )


@scenario(Settlement.DATABASE_FAILED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await _post(http, run, x_kill_conn="1")


@scenario(Settlement.COMMIT_PENDING)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, store=PostgresStore(run.schema, timeout=0.5))) as http:
        run.mark()
        response = await _post(http, run, x_slow_commit="1")
        # Checked here, before the COMMIT lands: in flight, then recorded. (The atomic mode
        # answers at the timeout while the COMMIT goes on in the request's own call, which an
        # in-process transport waits for: there the COMMIT has landed by now. Over the wire,
        # tests/test_atomic.py checks it answers in time.)
        if not modes.atomic():
            assert (await key_row(run.db, run.tenant, run.key))["state"] == "in_flight"
        await eventually(lambda: _state_is(run, "completed"))
        return response


@scenario(Settlement.RECORDED_APART)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        name = f"n-{run.key}"
        await http.post("/tx/name", content=name, headers=headers(run.tenant, new_key()))
        run.mark()
        return await http.post("/tx/name", content=name, headers=headers(run.tenant, run.key))


@scenario(Settlement.TRANSACTION_FAILED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        name = f"n-{run.key}"
        await http.post("/tx/name", content=name, headers=headers(run.tenant, new_key()))
        run.mark()
        return await http.post(
            "/tx/name-swallowed", content=name, headers=headers(run.tenant, run.key)
        )


@scenario(Settlement.TRANSACTION_ENDED)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await _post(http, run, x_end_transaction="COMMIT")


@scenario(Settlement.TRANSACTION_IDLE)
async def _(run: Run) -> httpx.Response:
    # The handler waits, on a session of its own, for a lock its request's transaction
    # holds: the wait is cancelled after the bound, and the handler raises.
    async with client(build_app(run.schema, transaction_idle_seconds=0.5)) as http:
        run.mark()
        return await _post(http, run, x_wait_on_itself="1")


@scenario(Settlement.TRANSACTION_CONFLICT)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema)) as http:
        run.mark()
        return await _post(http, run, x_commit_error="40001")


async def _lose_the_lease(run: Run, path: str) -> httpx.Response:
    # The owner is alive but its lease lapsed (a pause longer than the lease); a retry takes
    # the key over, and the stale owner's fenced completion finds the key no longer its own.
    async with client(build_app(run.schema, lease_seconds=30)) as http:
        stale = asyncio.create_task(_post(http, run, path, x_delay_ms="800"))
        await claimed(run.db, run.tenant, run.key)
        await run.db.execute(
            "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'"
            " WHERE tenant_id = $1 AND idempotency_key = $2",
            run.tenant,
            run.key,
        )
        winner = await _post(http, run, path)
        assert winner.status_code == 201
        run.mark()
        return await stale


@scenario(Settlement.LEASE_LOST)
async def _(run: Run) -> httpx.Response:
    return await _lose_the_lease(run, "/tx/charge")


@scenario(Settlement.KEY_TAKEN)
async def _(run: Run) -> httpx.Response:
    # A deploy that mixes versions: while an atomic request runs, another writer that does
    # not take the key's lock (an older server; here the test's own connection) records the
    # key first. The atomic request's record meets it at the primary key, and rolls back.
    async with client(build_app(run.schema, atomic=True)) as http:
        first = asyncio.create_task(_post(http, run, x_delay_ms="300"))
        # In its handler, so past its read of the key: the lock alone is had before the read,
        # and a row written in between was read (422), not met at the record.
        await eventually(lambda: _in_its_handler(run))
        await run.db.execute(
            "INSERT INTO idempotency_keys (tenant_id, idempotency_key, method, path,"
            " fingerprint, state, lease_token, lease_expires_at, format_version,"
            " response_status, response_headers, response_body, completed_at, expires_at)"
            " VALUES ($1, $2, 'POST', '/tx/charge', '\\x00', 'completed', 1, now(), 1, 201,"
            " '[]', '{}', now(), now() + interval '1 day')",
            run.tenant,
            run.key,
        )
        run.mark()
        response = await first
        assert await effects(run.db, run.tenant, run.key) == 0  # its writes rolled back
        return response


async def _in_its_handler(run: Run) -> bool:
    """The transaction that holds the key's lock has written to the effects table: its
    handler runs (read from pg_locks, taking nothing)."""
    return bool(
        await run.db.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_locks AS a JOIN pg_locks AS r ON r.pid = a.pid"
            " WHERE a.locktype = 'advisory' AND a.granted AND a.objsubid = 1"
            " AND ((a.classid::int8 << 32) | a.objid::int8) = $1"
            " AND r.locktype = 'relation' AND r.relation = 'effects'::regclass)",
            key_lock(run.tenant, run.key),
        )
    )


@scenario(Settlement.LEASE_LOST_PLAIN)
async def _(run: Run) -> httpx.Response:
    return await _lose_the_lease(run, "/plain/charge")


@scenario(Settlement.NOT_RECORDED)
async def _(run: Run) -> httpx.Response:
    store = PostgresStore(run.schema, timeout=0.3)
    async with client(build_app(run.schema, store=store)) as http:
        first = asyncio.create_task(_post(http, run, "/plain/charge", x_delay_ms="300"))
        await claimed(run.db, run.tenant, run.key)
        run.mark()
        # While the handler runs, the key table is locked for longer than the store's timeout:
        # its effect happens, and its answer cannot be recorded.
        async with run.db.acquire() as blocker, blocker.transaction():
            await blocker.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            response = await first
        return response


@scenario(Settlement.TOO_LARGE_TO_STORE)
async def _(run: Run) -> httpx.Response:
    async with client(build_app(run.schema, max_stored_response_bytes=10)) as http:
        run.mark()
        return await http.post("/big?size=100", headers=headers(run.tenant, run.key))


async def _state_is(run: Run, state: str) -> bool:
    row = await key_row(run.db, run.tenant, run.key)
    return row is not None and row["state"] == state


@pytest.fixture(scope="module")
async def read_only_dsn(db, schema):
    """A login role that may read the key table but not write it: the store's claims are
    refused for good."""
    from urllib.parse import urlsplit, urlunsplit

    role = "settlements_read_only"
    await db.execute(f"DROP ROLE IF EXISTS {role}")
    await db.execute(f"CREATE ROLE {role} LOGIN")
    await db.execute(f"GRANT SELECT ON idempotency_keys, idempotency_leases TO {role}")
    parts = urlsplit(schema)
    yield urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.split('@', 1)[-1]}"))
    await db.execute(f"REVOKE ALL ON idempotency_keys, idempotency_leases FROM {role}")
    await db.execute(f"DROP ROLE {role}")


def test_every_settlement_has_a_scenario():
    assert set(SCENARIOS) == set(Settlement)


@pytest.mark.parametrize("settlement", list(Settlement), ids=lambda s: s.name.lower())
async def test_each_settlement_is_what_its_row_says(
    settlement, schema, db, tenant, caplog, read_only_dsn
):
    if modes.atomic() and settlement in TWO_PHASE_ONLY:
        pytest.skip(f"{modes.VARIABLE}=atomic: {TWO_PHASE_ONLY[settlement]}")
    run = Run(schema, db, tenant, caplog, read_only_dsn)
    with caplog.at_level(logging.INFO, logger="idempotency_asgi"):
        response = await SCENARIOS[settlement](run)
    case = settlement.case

    # The answer.
    if case.problem is not None:
        assert_problem(response, case.status or response.status_code, case.problem)
    elif case.status is not None:
        assert response.status_code == case.status, response.text
    if settlement is Settlement.REPLAYED:
        assert response.headers["idempotent-replayed"] == "true"

    # One line for the request, with the outcome and level of its row.
    lines = run.lines()
    assert len(lines) == 1, [r.getMessage() for r in lines]
    [line] = lines
    fields = line.idempotency
    assert fields["case"] == settlement.name.lower()
    assert fields["outcome"] == case.outcome
    assert line.levelno == case.level
    assert fields["status"] == response.status_code

    # What became of the key.
    row = run.after if run.sealed is not None else await key_row(db, tenant, run.key)
    fate = case.fate
    if fate in (Fate.NONE, Fate.RELEASED):
        assert row is None
        if fate is Fate.NONE:
            count = await db.fetchval(
                "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = $1", run.key
            )
            assert count == 0
    elif fate is Fate.UNCHANGED and run.before is None and modes.atomic():
        assert row is None  # an atomic request in flight writes no row until it commits
    elif fate is Fate.UNCHANGED:
        assert run.before is not None and dict(row) == dict(run.before)
    elif fate is Fate.RECORDED:
        assert row["state"] == "completed" and row["response_body"] is not None
        assert fields["key_hash"] == key_hash(run.key)
    elif fate is Fate.RECORDED_WITHOUT_BODY:
        assert row["state"] == "completed" and row["response_body"] is None
    elif fate is Fate.HELD:
        assert row["state"] == "in_flight"
        assert not await db.fetchval(
            "SELECT count(*) FROM idempotency_leases WHERE tenant_id = $1"
            " AND idempotency_key = $2 AND lease_token = $3",
            tenant,
            run.key,
            row["lease_token"],
        )  # nobody renewed it
    elif fate is Fate.COMMITTING:
        assert row["state"] == "completed"  # the scenario saw it in flight first
    elif fate is Fate.ANOTHERS:
        assert row["state"] == "completed"
        assert response.headers.get("idempotency-key-expires") is None  # not this one's record


def test_the_contract_page_table_is_the_settlement_table():
    text = CONTRACT.read_text()
    found = re.search(r"<!-- table: settlements -->\n(.*?)<!-- /table -->", text, re.DOTALL)
    assert found, "docs/contract.md: the settlement table belongs between its table markers"
    assert found.group(1) == markdown_table(), (
        "docs/contract.md's 'What happens when' table differs from "
        "idempotency_asgi/_asgi/settlement.py: regenerate it with scripts/doc-tables"
    )
