"""The "Scaling out" plan, checked: every statement the package runs is read with PostgreSQL's
own parser, and each one that touches a distributed table must stay on one shard (filter by
tenant_id) unless it is listed below as spanning shards on purpose. No Citus runs here."""

from __future__ import annotations

import re

import pytest
from pglast.parser import ParseError

from idempotency_asgi._postgres import sql
from tests.server import ROOT
from tests.sql_routing import (
    has_limit,
    package_statements,
    route,
    touches_distributed,
    unparsable_sql_strings,
)

#: The statements allowed to span tenants (every shard). Adding one is a decision about the
#: plan: say here why it cannot filter by tenant, and say it on the docs' "Scaling out" page.
CROSS_SHARD = {
    # The reaper: finished keys of every tenant past their retention. One bounded batch
    # (LIMIT), run by the one maintenance runner or `idempotency-asgi reap`, never per request.
    "sql.REAP": "reaper",
    # The sweeper: in-flight keys of every tenant whose owner died long ago. Bounded, as above.
    "sql.SWEEP": "sweeper",
    # The sweeper's second half: lease rows of every tenant long past their end.
    "sql.FORGET_LEASES": "sweeper (lease rows)",
    # The reaper's second half: the idempotent consumer's dedup records, of every consumer.
    "sql.REAP_PROCESSED": "reaper (consumer records)",
    # `idempotency-asgi stats`: counts over the whole table, by an operator.
    "sql.STATS": "stats",
    # `idempotency-asgi held` without --tenant: the held keys of every tenant, by an operator
    # (or a reconciliation job), a bounded batch (LIMIT), taking no lock.
    "sql.HELD": "held keys (every tenant)",
    # On Citus (see _postgres/spread.py): which tenants have work for the reaper and the sweeper, a
    # bounded read (LIMIT) taking no lock; each tenant's batch is then one shard's.
    "sql.REAP_TENANTS": "reaper, on Citus (tenants with work)",
    "sql.SWEEP_TENANTS": "sweeper, on Citus (tenants with work)",
    "sql.FORGET_TENANTS": "sweeper, on Citus (tenants with lease rows to forget)",
    # On Citus: the consumer's records, distributed by message id, in one bounded statement.
    "sql.REAP_PROCESSED_SPREAD": "reaper (consumer records), on Citus",
    # Batched statements: under load one carries many requests' rows, of any tenants. A
    # distributed deployment makes its store with batch=False, and every statement on the
    # request path is one of HOT_PATH's again.
    "sql.CLAIM_MANY": "batched claims",
    "sql.PEEK_MANY": "batched first looks (the atomic mode)",
    "sql.COMPLETE_MANY": "batched completions",
    "sql.RELEASE_MANY": "batched releases",
    "sql.RENEW_MANY": "batched renewals",
}

#: Single-shard statements the parser cannot tell are: a table outer-joined on tenant_id to
#: one pinned in the WHERE (pinning it in the WHERE would undo the outer join).
#: tests/test_citus_plans.py shows the engine routing each to one shard.
JOINED_ON_TENANT = {
    # the lease rows LEFT JOINed to one tenant's key rows (ON l.tenant_id = $3 too)
    "sql.SWEEP_TENANT": "sweeper, on Citus, one tenant's batch",
}

#: The request path: each runs once or more per keyed request, always for one tenant ($1).
HOT_PATH = {
    "sql.CLAIM": 3,  # the existing row, its renewal, and the INSERT
    "sql.CLAIM_CAPPED": 5,  # the in-flight count and their renewals, then as above
    "sql.CLAIM_BOUNDED": 6,  # as CLAIM_CAPPED, and the stored-key count
    "sql.TAKE_OVER": 3,  # the key row it locks, its renewal, and the UPDATE
    "sql.PEEK": 2,  # the existing row, and its renewal
    "sql.READ": 2,  # the same, inside the atomic transaction
    "sql.RECORD_NEW": 1,  # the atomic record of a key that had no row
    "sql.COUNT_KEYS": 1,  # the tenant's stored keys
    "sql.RECORD": 2,  # the atomic record's INSERT (and the row it may replace), its waiters
    "sql.HOLD": 1,  # the atomic mode's key held after OutcomeUnknown (or the row it replaces)
    "sql.KEY_ROW": 1,  # who holds the key's row now
    "sql.HOLDS": 1,  # whether a lease still holds its key
    "sql.RENEW": 2,  # the lease row it writes, the key row it must still hold
    "sql.COMPLETE": 2,  # the key row, and the waiters' marks
    "sql.COMPLETE_BY_ROW": 2,  # the same, the key row found by its ctid
    "sql.RELEASE": 2,  # the key row and its lease row
    "sql.MARK_WAITING": 2,  # the lease row it writes, the key row it must still be in flight
    "sql.INSPECT": 3,  # not per request, but one tenant's key (and its renewal, twice)
    # Reconciliation (an operator's, for one tenant's key; see _postgres/reconcile.py):
    "sql.HOLD_LEASE": 1,  # a plain or two-phase request's key held after an unknown outcome
    "sql.HELD_TENANT": 3,  # one tenant's held keys, and their renewals (twice)
    "sql.SETTLE": 4,  # the key row it locks, its renewal, the UPDATE, and the waiters' marks
    "sql.RELEASE_KEY": 4,  # the key row it locks, its renewal, the DELETE, the lease row
    "sql.LOCK_FREE": 1,  # whether an atomic transaction holds the key (routed through it)
    # Where the key table is distributed by Citus (see _postgres/sql/claiming.py):
    "sql.INSERT_KEY": 1,  # the claim's INSERT, after its look
    "sql.LOOK_CAPPED": 4,  # PEEK's two, and the in-flight count and their renewals
    "sql.LOOK_BOUNDED": 5,  # as LOOK_CAPPED, and the stored-key count
    "sql.LOCK_KEY": 1,  # the atomic transaction's lock, routed through the key table
    "sql.RECORD_ROUTED": 1,  # the atomic record's INSERT alone
}

STATEMENTS = package_statements()


def test_every_string_in_sql_py_is_a_statement_postgresql_accepts():
    assert unparsable_sql_strings() == {}
    for name, text in STATEMENTS.items():
        try:
            route(text)
        except ParseError as exc:
            pytest.fail(f"{name} does not parse: {exc}")


def test_the_statements_come_from_the_whole_package():
    # _postgres/sql/ by name, f-strings as built; the rest of the package by its literals.
    assert {"sql.CLAIM", "sql.COMPLETE", "sql.REAP"} <= STATEMENTS.keys()
    assert {"consumer._RECORD", "consumer._RESULT", "consumer._STORED"} <= STATEMENTS.keys()
    assert "INSERT INTO idempotency_keys" in STATEMENTS["sql.CLAIM"]  # rendered, not a shell
    assert any(
        "idempotency_asgi_version" in text
        for name, text in STATEMENTS.items()
        if name.startswith("migrate:")
    )


@pytest.mark.parametrize("name", sorted(HOT_PATH))
def test_each_hot_path_statement_stays_on_its_tenants_shard(name):
    routing = route(STATEMENTS[name])
    assert routing.single_shard, routing.problems
    assert len(routing.references) == HOT_PATH[name]
    # _postgres/store.py passes the tenant first: every reference is pinned to that same parameter.
    assert {reference.pinned_to for reference in routing.references} == {1}


def test_only_the_listed_statements_span_shards():
    spanning = {
        name
        for name, text in STATEMENTS.items()
        if touches_distributed(text) and not route(text).single_shard
    }
    unlisted = spanning - CROSS_SHARD.keys() - JOINED_ON_TENANT.keys()
    assert not unlisted, {name: route(STATEMENTS[name]).problems for name in unlisted}
    # A listed statement that is gone, or that now filters by tenant, leaves the list.
    assert spanning == CROSS_SHARD.keys() | JOINED_ON_TENANT.keys()


@pytest.mark.parametrize(
    "name",
    [
        "sql.REAP",
        "sql.SWEEP",
        "sql.FORGET_LEASES",
        "sql.REAP_PROCESSED",
        "sql.REAP_TENANTS",
        "sql.SWEEP_TENANTS",
        "sql.FORGET_TENANTS",
        "sql.REAP_PROCESSED_SPREAD",
        "sql.HELD",
    ],
)
def test_cross_shard_maintenance_takes_bounded_batches(name):
    assert has_limit(STATEMENTS[name])


def test_a_claim_without_its_tenant_filter_is_caught():
    """The regression this file exists for: a claim whose existing-row branch forgot the
    tenant would read every shard (and, on one server, another tenant's row)."""
    unfiltered = sql.CLAIM.replace(
        "WHERE tenant_id = $1 AND idempotency_key", "WHERE idempotency_key"
    )
    assert unfiltered != sql.CLAIM
    routing = route(unfiltered)
    assert not routing.single_shard
    assert routing.problems == (
        "idempotency_keys in WITH existing: SELECT: no top-level tenant_id = $n",
    )
    capped = sql.CLAIM_CAPPED.replace("WHERE tenant_id = $1 AND state", "WHERE state")
    assert capped != sql.CLAIM_CAPPED
    assert route(capped).problems == (
        "idempotency_keys in WITH busy: subquery: SELECT: no top-level tenant_id = $n",
    )


@pytest.mark.parametrize(
    "statement",
    [
        # under OR: not a filter on every row
        "SELECT 1 FROM idempotency_keys WHERE tenant_id = $1 OR idempotency_key = $2",
        # under NOT
        "DELETE FROM idempotency_keys WHERE NOT (tenant_id = $1 AND idempotency_key = $2)",
        # no filter at all
        "UPDATE idempotency_keys SET has_waiters = true WHERE idempotency_key = $2",
        # a join on the column pins nothing by itself
        "SELECT 1 FROM idempotency_keys AS k JOIN idempotency_keys AS o"
        " ON o.tenant_id = k.tenant_id WHERE k.tenant_id = $1",
        # a range is not one shard
        "SELECT 1 FROM idempotency_keys WHERE tenant_id >= $1",
        # the filter names another table's alias
        "SELECT 1 FROM idempotency_keys AS k, payments AS p WHERE p.tenant_id = $1",
        # unqualified, with two tables in FROM: whose column is it?
        "SELECT 1 FROM idempotency_keys, payments WHERE tenant_id = $1",
        # two tenants in one statement
        "SELECT 1 FROM idempotency_keys WHERE tenant_id = $1"
        " UNION ALL SELECT 1 FROM idempotency_keys WHERE tenant_id = $3",
        # an INSERT whose tenant is not a parameter, or not one tenant
        "INSERT INTO idempotency_keys (tenant_id, idempotency_key) VALUES ('acme', $2)",
        "INSERT INTO idempotency_keys (tenant_id, idempotency_key) VALUES ($1, $2), ($3, $4)",
        "INSERT INTO idempotency_keys (idempotency_key) VALUES ($2)",
        # copied from a co-located table, but from every tenant's rows, or another group's
        "INSERT INTO idempotency_leases (tenant_id, idempotency_key)"
        " SELECT tenant_id, idempotency_key FROM idempotency_keys WHERE idempotency_key = $2",
        "INSERT INTO idempotency_leases (tenant_id, idempotency_key)"
        " SELECT tenant_id, idempotency_key FROM idempotency_keys WHERE tenant_id = $1"
        " OR idempotency_key = $2",
        "INSERT INTO idempotency_leases (tenant_id, idempotency_key)"
        " SELECT consumer, message_id FROM idempotency_processed_messages WHERE message_id = $1",
        # a subquery in a WHERE is its own reference
        "SELECT 1 FROM idempotency_keys WHERE tenant_id = $1"
        " AND EXISTS (SELECT 1 FROM idempotency_keys AS o WHERE o.state = 'in_flight')",
        # the consumer's table is distributed by message_id
        "SELECT result FROM idempotency_processed_messages WHERE consumer = $1",
    ],
)
def test_filters_that_do_not_pin_one_shard_are_caught(statement):
    assert not route(statement).single_shard


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1 FROM idempotency_keys WHERE $1 = tenant_id AND idempotency_key = $2",
        "SELECT 1 FROM idempotency_keys AS k WHERE k.tenant_id = $1::text",
        "SELECT 1 FROM public.idempotency_keys WHERE (tenant_id = $1 AND state = 'x')",
        "WITH t AS (SELECT 1 FROM idempotency_keys WHERE tenant_id = $4) SELECT * FROM t",
        "SELECT 1 FROM payments",  # not a table of the plan's
        # the tenant copied from a co-located table's rows of one tenant (Citus pushes it
        # down to that shard: see tests/test_citus_plans.py)
        "INSERT INTO idempotency_leases (tenant_id, idempotency_key)"
        " SELECT tenant_id, idempotency_key FROM idempotency_keys WHERE tenant_id = $1",
    ],
)
def test_filters_that_pin_one_shard_pass(statement):
    assert route(statement).single_shard, route(statement).problems


def test_the_scaling_out_page_names_every_statement_it_covers():
    section = (ROOT / "docs" / "scaling-out.md").read_text()
    for name, text in STATEMENTS.items():
        if name.startswith("sql.") and touches_distributed(text):
            assert re.search(rf"`{name[4:]}`", section), f"{name} is not in docs/scaling-out.md"
    assert "create_distributed_table('idempotency_keys', 'tenant_id'" in section
    assert "colocate_with" in section
