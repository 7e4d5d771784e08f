"""The library inside an application as teams write them (tests/real_app.py), over real HTTP
to real uvicorn processes, each mode on its own server, the database audited afterwards: a
handler's `COMMIT; BEGIN`, SQLAlchemy's `after_commit` listeners, event streams, a small
application pool, a second session of the application's own."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import asyncpg
import httpx
import pytest

from tests import server
from tests.helpers import assert_problem, eventually, key_locked, new_key
from tests.real_app import TABLES

#: The transactional modes, each on a server of its own: two-phase (the transaction lent
#: when the handler asks), atomic with a DSN store, atomic on the application's pool of 2.
MODES = {
    "two-phase": {},
    "atomic": {"REAL_ATOMIC": "1"},
    "atomic-pool": {"REAL_ATOMIC": "1", "REAL_POOL": "2"},
}


def serve(dsn: str, **env: str) -> server.UvicornProcess:
    return server.UvicornProcess(
        "tests.real_app:app", {"DATABASE_URL": dsn, "REAL_APP_SERVE": "1", **env}
    ).start(ready_path="/ready")


@pytest.fixture(scope="module")
async def tables(schema: str) -> str:
    conn = await asyncpg.connect(schema)
    try:
        await conn.execute(TABLES)
    finally:
        await conn.close()
    return schema


@pytest.fixture(scope="module", params=list(MODES))
def app(request: pytest.FixtureRequest, tables: str) -> Iterator[tuple[str, str]]:
    process = serve(tables, **MODES[request.param])
    try:
        yield request.param, process.url
    finally:
        process.stop()


def keyed(tenant: str, key: str, **more: str) -> dict[str, str]:
    extra = {name.replace("_", "-"): value for name, value in more.items()}
    return {"x-tenant": tenant, "idempotency-key": key, **extra}


async def orders(db: asyncpg.Pool, key: str) -> int:
    return int(
        await db.fetchval("SELECT count(*) FROM real_orders WHERE idempotency_key = $1", key)
    )


async def emails(db: asyncpg.Pool, key: str) -> list[str]:
    rows = await db.fetch(
        "SELECT what FROM real_emails WHERE idempotency_key = $1 ORDER BY id", key
    )
    return [row["what"] for row in rows]


@pytest.mark.parametrize("path", ["/orders", "/raw"])
@pytest.mark.parametrize("failure", ["commit-begin-raise", "commit-begin-502"])
async def test_a_handler_that_commits_and_begins_again_has_its_key_held(
    app, db, tenant, path, failure
):
    """Item 1: `COMMIT; BEGIN` (raw, or through the session's `text()`), then a failure. What
    the handler committed happened; the record must never commit with the later transaction,
    and the key must not be freed for a retry to commit it again: 500, held, one order."""
    mode, url = app
    key = new_key()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        answers = [
            await http.post(path, json={}, headers=keyed(tenant, key, x_then=failure))
            for _ in range(3)
        ]
    assert_problem(answers[0], 500, "transaction-ended-by-handler")
    assert [a.status_code for a in answers[1:]] == [409, 409], (mode, answers)
    assert await orders(db, key) == 1
    row = await db.fetchrow(
        "SELECT state, held_reason FROM idempotency_keys WHERE tenant_id = $1"
        " AND idempotency_key = $2",
        tenant,
        key,
    )
    assert (row["state"], row["held_reason"]) == ("in_flight", "transaction-ended")


async def test_after_commit_work_waits_for_the_real_commit(app, db, tenant):
    """Item 2: the session's `after_commit` listener (the usual place for the confirmation
    e-mail) and `after_commit(request, fn)` run once the request's transaction has really
    committed: never for a commit of the session's that the request then rolled back, never
    again for a replay."""
    _, url = app
    failing, succeeding, hooked = new_key(), new_key(), new_key()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(3):  # commit, then 503: rolled back, the key freed, retried
            failed = await http.post(
                "/orders", json={}, headers=keyed(tenant, failing, x_then="commit-503")
            )
            assert failed.status_code == 503
        first = await http.post("/orders", json={}, headers=keyed(tenant, succeeding))
        replay = await http.post("/orders", json={}, headers=keyed(tenant, succeeding))
        raw = await http.post("/raw", json={}, headers=keyed(tenant, hooked))
        raw_replay = await http.post("/raw", json={}, headers=keyed(tenant, hooked))
    assert first.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert raw.status_code == 201 and raw_replay.headers["idempotent-replayed"] == "true"
    await eventually(lambda: emails_arrived(db, succeeding, hooked))
    await asyncio.sleep(0.5)  # anything more that was going to be sent has been
    assert (await orders(db, failing), await emails(db, failing)) == (0, [])
    assert (await orders(db, succeeding), await emails(db, succeeding)) == (1, ["confirmation"])
    assert (await orders(db, hooked), await emails(db, hooked)) == (1, ["receipt"])


async def emails_arrived(db: asyncpg.Pool, *keys: str) -> bool:
    return all([await emails(db, key) for key in keys])


async def test_an_event_stream_is_sent_as_it_comes_and_stops_with_its_client(app, db, tenant):
    """Item 5: a keyed POST answering `text/event-stream`. The first event reaches the client
    at once; its writes commit when the stream starts; when the client leaves, the stream
    stops (the application hears the disconnect); no connection stays pinned (two
    abandoned streams on the pool of two, and another keyed POST still runs); a retry is
    told the answer is not replayable."""
    mode, url = app
    keys = [new_key(), new_key()]
    for key in keys:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = time.monotonic()
            async with http.stream("POST", "/stream", json={}, headers=keyed(tenant, key)) as got:
                assert got.headers["content-type"].startswith("text/event-stream")
                lines = got.aiter_lines()
                first = await asyncio.wait_for(anext(lines), 5)
                waited = time.monotonic() - started
            # The client has left, mid-stream.
        assert first == "data: token 0", first
        assert waited < 1.0, waited
    for key in keys:
        stopped = await eventually(lambda key=key: emails(db, key))
        assert stopped[0].startswith("stream stopped after"), stopped
        assert await orders(db, key) == 1
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        other = await http.post("/raw", json={}, headers=keyed(tenant, new_key()))
        retry = await http.post("/stream", json={}, headers=keyed(tenant, keys[0]))
    assert other.status_code == 201, (mode, other.text)
    assert_problem(retry, 409, "response-not-replayable")
    assert await orders(db, keys[0]) == 1


@pytest.mark.parametrize("mode", list(MODES))
async def test_shutdown_finishes_with_streams_open(tables, tenant, mode):
    """Item 5: a graceful shutdown (SIGTERM) while two clients hold streams open, and two
    more have left theirs: the process ends, with the streams ended for it."""
    process = serve(tables, **MODES[mode])
    clients: list[httpx.AsyncClient] = []
    try:
        for _ in range(2):
            http = httpx.AsyncClient(base_url=process.url, timeout=30)
            clients.append(http)
            request = http.build_request(
                "POST", "/stream", json={}, headers=keyed(tenant, new_key())
            )
            response = await http.send(request, stream=True)
            await asyncio.wait_for(anext(response.aiter_lines()), 5)
        assert process.process is not None
        process.process.send_signal(signal.SIGTERM)
        ended = await asyncio.to_thread(process.process.wait, 30)
    finally:
        for http in clients:
            await http.aclose()
        process.stop()
    assert ended is not None


async def test_a_small_pool_answers_duplicates_and_replays_without_waiting(tables, db, tenant):
    """Item 6: the store made from the application's pool of one connection. While one slow
    request holds it, its duplicate is told 409 at once and a finished key's replay is
    served at once; only a new key waits for the connection."""
    process = serve(tables, REAL_ATOMIC="1", REAL_POOL="1")
    finished, running = new_key(), new_key()
    try:
        async with httpx.AsyncClient(base_url=process.url, timeout=30) as http:
            first = await http.post("/slow", json={}, headers=keyed(tenant, finished))
            slow = asyncio.create_task(
                http.post("/slow", json={}, headers=keyed(tenant, running, x_delay_ms="4000"))
            )
            await eventually(lambda: orders_locked(db, tenant, running))
            started = time.monotonic()
            duplicate = await http.post("/slow", json={}, headers=keyed(tenant, running))
            replay = await http.post("/slow", json={}, headers=keyed(tenant, finished))
            answered = time.monotonic() - started
            assert (await slow).status_code == 201
    finally:
        process.stop()
    assert first.status_code == 201
    assert_problem(duplicate, 409, "request-in-progress")
    assert "retry-after" in duplicate.headers
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert answered < 1.5, answered
    assert await orders(db, running) == 1


async def orders_locked(db: asyncpg.Pool, tenant: str, key: str) -> bool:
    return await key_locked(db, tenant, key)


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_handler_waiting_on_its_own_transaction_ends_in_time(tables, db, tenant, mode):
    """Item 7: a handler writes a row through the request's session, then through a session
    of its own (the application's old one), which waits for the request's transaction:
    before, the request never answered and shutdown hung. Now the waiting statement is
    cancelled after `transaction_idle_seconds`, the request answers 500 transaction-idle,
    its key is held, the server goes on serving, and shuts down."""
    process = serve(tables, REAL_IDLE_SECONDS="2", **MODES[mode])
    key = new_key()
    await db.execute("INSERT INTO real_accounts (tenant, balance) VALUES ($1, 0)", tenant)
    try:
        async with httpx.AsyncClient(base_url=process.url, timeout=30) as http:
            started = time.monotonic()
            stuck = await http.post("/accounts/credit", json={}, headers=keyed(tenant, key))
            took = time.monotonic() - started
            retry = await http.post("/accounts/credit", json={}, headers=keyed(tenant, key))
            other = await http.post("/raw", json={}, headers=keyed(tenant, new_key()))
        assert process.process is not None
        process.process.send_signal(signal.SIGTERM)
        ended = await asyncio.to_thread(process.process.wait, 30)
    finally:
        process.stop()
    assert_problem(stuck, 500, "transaction-idle")
    assert 1.5 < took < 10, took
    assert retry.status_code == 409
    assert other.status_code == 201
    assert ended is not None
    # What the request's transaction wrote rolled back, and the handler's own session's write
    # was the statement cancelled: neither happened.
    balance = await db.fetchval("SELECT balance FROM real_accounts WHERE tenant = $1", tenant)
    assert balance == 0
