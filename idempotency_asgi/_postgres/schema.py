"""The schema, as an ordered list of revisions.

This is the one source of the DDL: the repository's Alembic revisions execute these statements,
and `idempotency-asgi migrate` (see `migrate.py`) applies them without Alembic. Both record the
applied revision in the same Alembic-shaped version table, so either tool can take over from the
other. Each statement is executed on its own (asyncpg runs one statement per call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .sql import onecommit

VERSION_TABLE = "idempotency_asgi_version"

#: Held (transaction-scoped) while migrating, so that several workers starting at once apply
#: each revision exactly once. The number is arbitrary but fixed: "idem" in ASCII.
MIGRATION_LOCK_ID = 0x6964656D


@dataclass(frozen=True)
class Revision:
    id: str
    down_revision: str | None
    upgrade: tuple[str, ...]
    downgrade: tuple[str, ...]


REVISIONS: tuple[Revision, ...] = (
    Revision(
        id="0001",
        down_revision=None,
        upgrade=(
            """
            CREATE TABLE idempotency_keys (
                tenant_id         text        NOT NULL,
                idempotency_key   text        NOT NULL,
                method            text        NOT NULL,
                path              text        NOT NULL,
                fingerprint       bytea       NOT NULL,
                state             text        NOT NULL
                                  CHECK (state IN ('in_flight', 'completed')),
                lease_token       bigint      NOT NULL,
                lease_expires_at  timestamptz NOT NULL,
                format_version    smallint    NOT NULL,
                response_status   smallint,
                response_headers  bytea,
                response_body     bytea,
                -- set by a duplicate that waits for this request instead of taking a 409:
                -- completion and release NOTIFY only then (NOTIFY takes a commit-time lock)
                has_waiters       boolean     NOT NULL DEFAULT false,
                created_at        timestamptz NOT NULL DEFAULT now(),
                completed_at      timestamptz,
                expires_at        timestamptz NOT NULL,
                PRIMARY KEY (tenant_id, idempotency_key)
            )
            """,
            # The reaper's scan: finished rows past their retention.
            """
            CREATE INDEX idempotency_keys_expired_idx
                ON idempotency_keys (expires_at) WHERE state = 'completed'
            """,
            # In-flight rows only (few: about as many as requests running): the sweeper's scan
            # by lease expiry and the per-tenant in-flight cap's count both read it.
            """
            CREATE INDEX idempotency_keys_in_flight_idx
                ON idempotency_keys (tenant_id, lease_expires_at) WHERE state = 'in_flight'
            """,
        ),
        downgrade=("DROP TABLE idempotency_keys",),
    ),
    Revision(
        id="0002",
        down_revision="0001",
        upgrade=(
            # The idempotent consumer's dedup records (see consumer.py): one row per message a
            # consumer has processed, written in the same transaction as its effects.
            """
            CREATE TABLE idempotency_processed_messages (
                consumer      text        NOT NULL,
                message_id    text        NOT NULL,
                result        bytea,
                processed_at  timestamptz NOT NULL DEFAULT now(),
                PRIMARY KEY (consumer, message_id)
            )
            """,
            """
            CREATE INDEX idempotency_processed_messages_age_idx
                ON idempotency_processed_messages (processed_at)
            """,
        ),
        downgrade=("DROP TABLE idempotency_processed_messages",),
    ),
    Revision(
        id="0003",
        down_revision="0002",
        upgrade=(
            # A row is completed exactly when it has a completion time. The statements about
            # one in-flight key test `completed_at IS NULL` (see sql/: it keeps the planner
            # on the primary key); this makes that the same as `state = 'in_flight'`. NOT
            # VALID: every write is checked from now on, and the rows already there (which
            # every version of this package wrote that way) are not scanned, so the upgrade
            # holds its lock for a moment whatever the table's size.
            """
            ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_completed_check
                CHECK ((state = 'completed') = (completed_at IS NOT NULL)) NOT VALID
            """,
        ),
        downgrade=(
            "ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_completed_check",
        ),
    ),
    Revision(
        id="0004",
        down_revision="0003",
        upgrade=(
            # Lease renewals and waiting duplicates' marks, kept off the key row (see sql/):
            # a handler's REPEATABLE READ transaction completes that row, and must not find it
            # changed since its snapshot by its own heartbeat. A row only for keys whose
            # request ran longer than a third of its lease, or that somebody waited for.
            """
            CREATE TABLE idempotency_leases (
                tenant_id         text        NOT NULL,
                idempotency_key   text        NOT NULL,
                lease_token       bigint      NOT NULL,
                lease_expires_at  timestamptz NOT NULL,
                has_waiters       boolean     NOT NULL DEFAULT false,
                PRIMARY KEY (tenant_id, idempotency_key)
            )
            """,
            # The sweeper's scan for lease rows long past.
            """
            CREATE INDEX idempotency_leases_expires_idx
                ON idempotency_leases (lease_expires_at)
            """,
        ),
        downgrade=("DROP TABLE idempotency_leases",),
    ),
    Revision(
        id="0005",
        down_revision="0004",
        upgrade=(
            # Why an in-flight key is held rather than running (see _records.HeldReason):
            # NULL for every row that is not held. Nullable with no default, so adding it
            # changes the catalog only: no rewrite, a moment's lock on a live table.
            "ALTER TABLE idempotency_keys ADD COLUMN held_reason text",
        ),
        downgrade=("ALTER TABLE idempotency_keys DROP COLUMN held_reason",),
    ),
    Revision(
        id="0006",
        down_revision="0005",
        # The atomic mode's functions (see sql/onecommit.py): created in the key table's
        # schema, and replaced as a whole; nothing on the tables changes.
        upgrade=onecommit.INSTALL,
        downgrade=onecommit.UNINSTALL,
    ),
)

HEAD = REVISIONS[-1].id


def alembic_steps(revision_id: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """`upgrade, downgrade = alembic_steps("0001")` in an Alembic revision file: the
    revision's statements, executed one by one through Alembic's `op`."""
    from alembic import op

    revision = next(r for r in REVISIONS if r.id == revision_id)

    def upgrade() -> None:
        for statement in revision.upgrade:
            op.execute(statement)

    def downgrade() -> None:
        for statement in revision.downgrade:
            op.execute(statement)

    return upgrade, downgrade
