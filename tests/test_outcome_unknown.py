"""A transactional handler that wrote and then cannot tell whether its outcome happened
(OutcomeUnknown): its writes roll back, its connection goes back to the pool, and its key stays
in flight until the lease lapses, so no retry runs while the first attempt might still take
effect. Audited in PostgreSQL: the effects table, the key row, and the sessions still open."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_asgi import PostgresStore
from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, headers, key_row, new_key

#: Sessions of one application still inside a transaction.
OPEN_TRANSACTIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND state LIKE 'idle in transaction%'
"""


async def test_a_transactional_write_before_an_unknown_outcome_rolls_back_and_holds_the_key(
    schema, db, tenant
):
    application = f"outcome-unknown-{tenant}"
    store = PostgresStore(
        schema, pool_options={"server_settings": {"application_name": application}}
    )
    app = build_app(schema, store=store, lease_seconds=1.0)
    key = new_key()

    async def scenario():
        async with client(app) as http:
            unknown = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, key, x_unknown="1")
            )
            left_open = await db.fetchval(OPEN_TRANSACTIONS, application)
            row = await key_row(db, tenant, key)
            written = await effects(db, tenant, key)
            meanwhile = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            await asyncio.sleep(1.3)  # nothing renews the lease any more: it lapses
            later = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        return unknown, left_open, row, written, meanwhile, later

    try:
        unknown, left_open, row, written, meanwhile, later = await asyncio.wait_for(scenario(), 20)
    except asyncio.TimeoutError:
        pytest.fail(
            "the application did not shut down: a connection was never given back to the pool "
            "(the request's transaction was left open)"
        )
    assert_problem(unknown, 504, "outcome-unknown")
    assert int(unknown.headers["retry-after"]) >= 1
    assert left_open == 0  # rolled back, not left holding its locks
    assert written == 0  # the write was never committed
    assert row["state"] == "in_flight"  # neither recorded nor released
    assert_problem(meanwhile, 409, "request-in-progress")
    # Once the lease lapsed, the retry ran, and its write is the only one.
    assert later.status_code == 201 and "idempotent-replayed" not in later.headers
    assert await effects(db, tenant, key) == 1
    assert (await key_row(db, tenant, key))["state"] == "completed"
