"""The example's own tables, brought up to date at startup (after the library's migrations).

Several workers may start at once: the DDL runs in one transaction under an advisory lock.
"""

from __future__ import annotations

from typing import Any

from idempotency_asgi import migrate

LOCK_ID = 0x7061796D  # "paym"

STATEMENTS = (
    """
    CREATE TABLE IF NOT EXISTS payments (
        id           text        PRIMARY KEY,
        tenant_id    text        NOT NULL,
        amount       bigint      NOT NULL CHECK (amount > 0),
        currency     text        NOT NULL,
        customer_id  text        NOT NULL,
        status       text        NOT NULL,
        idempotency_key text,
        created_at   timestamptz NOT NULL DEFAULT now()
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS payments_tenant_created_idx
        ON payments (tenant_id, created_at DESC, id DESC)
    """,
    """
    CREATE TABLE IF NOT EXISTS outbox (
        id              bigserial   PRIMARY KEY,
        tenant_id       text        NOT NULL,
        payment_id      text        NOT NULL REFERENCES payments (id),
        event_type      text        NOT NULL,
        idempotency_key text        NOT NULL,
        payload         bytea       NOT NULL,
        state           text        NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'delivered', 'dead')),
        attempts        integer     NOT NULL DEFAULT 0,
        next_attempt_at timestamptz NOT NULL DEFAULT now(),
        last_error      text,
        created_at      timestamptz NOT NULL DEFAULT now(),
        delivered_at    timestamptz
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS outbox_pending_idx
        ON outbox (next_attempt_at) WHERE state = 'pending'
    """,
    # The fake payment provider (provider.py) keeps its books in a schema of its own: in real
    # life it is another company's database, reachable only over HTTP.
    "CREATE SCHEMA IF NOT EXISTS provider",
    """
    CREATE TABLE IF NOT EXISTS provider.charges (
        id              text        PRIMARY KEY,
        idempotency_key text        NOT NULL,
        payment_id      text        NOT NULL,
        tenant_id       text        NOT NULL,
        amount          bigint      NOT NULL,
        currency        text        NOT NULL,
        created_at      timestamptz NOT NULL DEFAULT now()
    )
    """,
    # Every delivery that arrived, duplicates included: proof that delivery is at least once.
    """
    CREATE TABLE IF NOT EXISTS provider.deliveries (
        id              bigserial   PRIMARY KEY,
        idempotency_key text        NOT NULL,
        first           boolean     NOT NULL,
        received_at     timestamptz NOT NULL DEFAULT now()
    )
    """,
)


async def bring_up_to_date(conn: Any, dsn: str) -> None:
    await migrate(dsn)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
        for statement in STATEMENTS:
            await conn.execute(statement)
