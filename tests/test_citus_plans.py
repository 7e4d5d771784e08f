"""Every statement the package runs per request, on a real Citus cluster: Citus accepts it,
plans it as a router query (one task, on the worker that holds the tenant's shard, no
subplan, nothing pulled through the coordinator), and runs it there alone. The pglast audit
(tests/test_sql_tenancy.py) reads where a statement would go; this asks the engine.

The statements the store never sends where the key table is distributed (the one-statement
claims, whose INSERT in a WITH Citus runs step by step over every worker with a two-phase
commit; the batched ones, which carry many tenants' rows) are listed with what replaces them,
and shown to be what the listing says they are."""

from __future__ import annotations

import os
from typing import Any

import asyncpg
import pytest

from idempotency_asgi._postgres import consumer as _consumer
from idempotency_asgi._postgres import sql
from tests.citus_cluster import log_listener, remote_commands, worker_of
from tests.test_sql_tenancy import HOT_PATH

pytestmark = pytest.mark.citus

#: Run per request where the key table is distributed (and `inspect`, `held --tenant`,
#: `settle` and `release`, per operator's action).
ROUTED = {
    "sql.PEEK": sql.PEEK,
    "sql.LOOK_CAPPED": sql.LOOK_CAPPED,
    "sql.LOOK_BOUNDED": sql.LOOK_BOUNDED,
    "sql.INSERT_KEY": sql.INSERT_KEY,
    "sql.TAKE_OVER": sql.TAKE_OVER,
    "sql.LOCK_KEY": sql.LOCK_KEY,
    "sql.READ": sql.READ,
    "sql.KEY_ROW": sql.KEY_ROW,
    "sql.COUNT_KEYS": sql.COUNT_KEYS,
    "sql.RECORD_ROUTED": sql.RECORD_ROUTED,
    "sql.HOLD": sql.HOLD,
    "sql.HOLDS": sql.HOLDS,
    "sql.RENEW": sql.RENEW,
    "sql.COMPLETE": sql.COMPLETE,
    "sql.RELEASE": sql.RELEASE,
    "sql.MARK_WAITING": sql.MARK_WAITING,
    "sql.LOCK_FREE": sql.LOCK_FREE,
    "sql.INSPECT": sql.INSPECT,
    "sql.HOLD_LEASE": sql.HOLD_LEASE,
    "sql.HELD_TENANT": sql.HELD_TENANT,
    "sql.SETTLE": sql.SETTLE,
    "sql.RELEASE_KEY": sql.RELEASE_KEY,
}

#: Maintenance, one tenant's batch (idempotency_asgi/_postgres/spread.py): the tenant is $2 or $3.
MAINTENANCE = {
    "sql.REAP_TENANT": (sql.REAP_TENANT, [100]),
    "sql.SWEEP_TENANT": (sql.SWEEP_TENANT, [100, 0.0]),
    "sql.FORGET_TENANT": (sql.FORGET_TENANT, [100, 0.0]),
}

#: The idempotent consumer's statements: routed by message id (its table's distribution
#: column), the consumer's name being $1 and the message id $2.
CONSUMER = {
    "consumer._RECORD": _consumer._RECORD,
    "consumer._RESULT": _consumer._RESULT,
    "consumer._STORED": _consumer._STORED,
}

#: Statements of the request path that the store does not send where the key table is
#: distributed, and what it sends instead.
NOT_ON_CITUS = {
    "sql.CLAIM": "PEEK, then INSERT_KEY",
    "sql.CLAIM_CAPPED": "LOOK_CAPPED, then INSERT_KEY",
    "sql.CLAIM_BOUNDED": "LOOK_BOUNDED, then INSERT_KEY",
    "sql.RECORD": "RECORD_ROUTED (the INSERT without the WITH that wakes waiters)",
}


#: Statements of the request path only a single server is sent, for what they rely on.
ONE_SERVER = {
    "sql.RECORD_NEW": "the atomic mode's session lock, which Citus sends nowhere (RECORD_ROUTED)",
    "sql.COMPLETE_BY_ROW": "a ctid, which names a row of one shard's table (COMPLETE, by key)",
}


def test_every_request_path_statement_is_checked_here():
    assert set(HOT_PATH) <= set(ROUTED) | set(NOT_ON_CITUS) | set(ONE_SERVER)


def _arguments(statement: Any, tenant: str, key: str) -> list[Any]:
    """Values of the statement's parameter types: the tenant first, the key second."""
    samples = {
        "bytea": b"\x01" * 32,
        "int8": 42,
        "int4": 5,
        "int2": 200,
        "float8": 30.0,
        "bool": False,
    }
    values: list[Any] = []
    for number, parameter in enumerate(statement.get_parameters(), start=1):
        if parameter.name == "text":
            values.append({1: tenant, 2: key}.get(number, "in_flight"))
        else:
            values.append(samples[parameter.name])
    return values


async def _explained(conn: Any, text: str, args: list[Any]) -> str:
    rows = await conn.fetch("EXPLAIN (COSTS OFF) " + text, *args)
    return "\n".join(row[0] for row in rows)


def _assert_router(plan: str, port: int) -> None:
    lines = [line.strip() for line in plan.splitlines()]
    assert lines[0] == "Custom Scan (Citus Adaptive)", plan
    assert lines.count("Task Count: 1") == 1 and sum("Task Count" in x for x in lines) == 1, plan
    assert not any("Distributed Subplan" in line for line in lines), plan
    assert not any("INSERT ... SELECT" in line or "pull to coordinator" in line for line in lines)
    nodes = [line for line in lines if line.startswith("Node: ")]
    assert nodes == [f"Node: host=127.0.0.1 port={port} dbname=postgres"], plan


@pytest.mark.parametrize("name", sorted(ROUTED))
async def test_each_request_path_statement_is_a_router_query(citus, tenant, name):
    """EXPLAIN shows one task on the tenant's worker; run (more than five times, so that
    PostgreSQL may switch the prepared statement to its generic plan, which Citus prunes at
    run time), every command it makes goes to that worker, inside the one transaction."""
    conn = await asyncpg.connect(citus.coordinator)
    messages: list[str] = []
    try:
        port = await worker_of(conn, tenant)
        statement = await conn.prepare(ROUTED[name])
        args = _arguments(statement, tenant, f"k-{os.urandom(4).hex()}")
        _assert_router(await _explained(conn, ROUTED[name], args), port)
        conn.add_log_listener(log_listener(messages))
        await conn.execute("SET citus.log_remote_commands = on; SET client_min_messages = log")
        for _ in range(7):
            messages.clear()
            async with conn.transaction():
                await statement.fetch(*args)
                sent = remote_commands(messages)
            assert {server for server, _ in sent} == {f"127.0.0.1:{port}"}, sent
            # BEGIN (with the distributed transaction's id), the statement, and nothing else
            # on the way (no intermediate results, no COPY)
            assert len(sent) == 2 and sent[0][1].startswith("BEGIN"), sent
            assert not any(command.startswith("COPY") for _, command in sent), sent
    finally:
        await conn.close()


@pytest.mark.parametrize("name", sorted(MAINTENANCE))
async def test_each_tenants_maintenance_batch_is_a_router_query(citus, tenant, name):
    """Row locks (FOR UPDATE SKIP LOCKED) are Citus's only in a router query: each
    tenant's batch is one, on the tenant's worker."""
    text, args = MAINTENANCE[name]
    conn = await asyncpg.connect(citus.coordinator)
    try:
        port = await worker_of(conn, tenant)
        _assert_router(await _explained(conn, text, [*args, tenant]), port)
        await conn.execute(text, *args, tenant)
    finally:
        await conn.close()


@pytest.mark.parametrize("name", sorted(CONSUMER))
async def test_the_consumers_statements_are_router_queries_by_message_id(citus, name):
    conn = await asyncpg.connect(citus.coordinator)
    try:
        message = f"m-{os.urandom(6).hex()}"
        port = await conn.fetchval(
            "SELECT n.nodeport FROM pg_dist_placement AS p JOIN pg_dist_node AS n"
            " USING (groupid) WHERE p.shardid = get_shard_id_for_distribution_column("
            "'idempotency_processed_messages', $1::text)",
            message,
        )
        statement = await conn.prepare(CONSUMER[name])
        args: list[Any] = ["provider", message, b"result"][: len(statement.get_parameters())]
        _assert_router(await _explained(conn, CONSUMER[name], args), port)
        async with conn.transaction():
            await statement.fetch(*args)
    finally:
        await conn.close()


@pytest.mark.parametrize("name", sorted(NOT_ON_CITUS))
async def test_what_the_store_does_not_send_there_is_not_a_router_query(citus, tenant, name):
    """Why the store does not send them there: Citus plans an INSERT inside a WITH as a
    subplan of its own, run through the coordinator."""
    conn = await asyncpg.connect(citus.coordinator)
    try:
        text = getattr(sql, name.removeprefix("sql."))
        statement = await conn.prepare(text)
        args = _arguments(statement, tenant, f"k-{os.urandom(4).hex()}")
        plan = await _explained(conn, text, args)
        assert "Distributed Subplan" in plan, plan
    finally:
        await conn.close()
