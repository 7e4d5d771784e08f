"""The store begins, commits and rolls back a request's transaction together with statements
of its own in one round trip (`_postgres/asyncpg_transactions.py`: begin_with, commit_with,
rollback_with), which needs asyncpg's private transaction state. Where that is not there (an
asyncpg that changed it), each falls back to asyncpg's own transaction calls and a round trip
more. Here it is hidden from the store, and both transactional modes must keep their contract:
one effect per key, nothing of a failed request, and no lock of the store's left on a pooled
connection for the next request to trip over."""

from __future__ import annotations

import asyncpg
import pytest

from idempotency_asgi._postgres import asyncpg_transactions as transactions
from idempotency_asgi.maintenance import MAINTENANCE_LOCK_ID
from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, eventually, headers, new_key

pytestmark = pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "two-phase"])


@pytest.fixture(autouse=True)
def no_private_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # As an asyncpg without it would: asyncpg's own module keeps it, which it needs.
    monkeypatch.setattr(transactions, "private_transaction_state", lambda: None)


async def _locks_left(db: asyncpg.Pool) -> int:
    """Advisory locks that idle sessions of this database hold, but the maintenance runner's."""
    count: int = await db.fetchval(
        "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND a.state = 'idle'"
        " AND a.datname = current_database()"
        " AND ((l.classid::int8 << 32) | l.objid::int8) <> $1",
        MAINTENANCE_LOCK_ID,
    )
    return count


async def test_the_fallback_is_what_runs(schema, atomic):
    conn = await asyncpg.connect(schema)
    try:
        assert await transactions.begin_with(conn, "BEGIN; SELECT 1") is None
        tx = conn.transaction()
        await tx.start()
        assert await transactions.commit_with(tx, "COMMIT") is False
        assert await transactions.rollback_with(tx, "ROLLBACK") is False
        await tx.rollback()
    finally:
        await conn.close()


async def test_new_keys_replays_and_failures_keep_the_contract(schema, db, tenant, atomic):
    app = build_app(schema, atomic=atomic)
    key, failing = new_key(), new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={"n": 1}, headers=headers(tenant, key))
        again = await http.post("/tx/charge", json={"n": 1}, headers=headers(tenant, key))
        reused = await http.post("/tx/charge", json={"n": 2}, headers=headers(tenant, key))
        with pytest.raises(RuntimeError, match="handler failed after its write"):
            # In process, the server's 500 is the exception itself.
            await http.post(
                "/tx/charge", json={}, headers=headers(tenant, failing, **{"x-raise": "1"})
            )
        retried = await http.post("/tx/charge", json={}, headers=headers(tenant, failing))
        declined = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, new_key(), **{"x-status": "402"})
        )
        # Every connection of the pool has served one of those: none carries a lock over, nor
        # asyncpg's view of a transaction (a handler's own savepoints, each time).
        for _ in range(12):
            answer = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, new_key(), x_savepoint="1")
            )
            assert answer.status_code == 201, answer.text

        async def no_locks_left() -> bool:
            return await _locks_left(db) == 0

        await eventually(no_locks_left)
    assert first.status_code == 201, first.text
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["effect_id"] == first.json()["effect_id"]
    assert_problem(reused, 422, "key-reused")
    assert retried.status_code == 201
    assert declined.status_code == 402
    assert await effects(db, tenant, key) == 1
    assert await effects(db, tenant, failing) == 1  # the raise rolled its write back
    assert await effects(db, tenant) == 1 + 1 + 1 + 12 * 2  # each with its savepoint's


async def test_a_commit_gets_a_timer_only_where_the_connection_would_time_it_out(schema, atomic):
    # Whether a connection has a command_timeout is asyncpg's private state: without one a
    # COMMIT is sent with no timer at all; with one (or where asyncpg does not say) with a
    # timeout too long to ever cancel it.
    plain = await asyncpg.connect(schema)
    timed = await asyncpg.connect(schema, command_timeout=5)
    try:
        assert transactions.commit_timeout(plain) is None
        assert transactions.commit_timeout(timed) == transactions.COMMIT_TIMEOUT
        assert transactions.commit_timeout(object()) == transactions.COMMIT_TIMEOUT
    finally:
        await plain.close()
        await timed.close()
