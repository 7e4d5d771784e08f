"""For teams with their own Alembic migrations (`pip install 'idempotency-asgi[alembic]'`).

- `include_object` and `include_name`, for `context.configure(...)` in your `env.py`: your
  autogenerate then never proposes to drop or alter the library's tables (they are in your
  database, and not in your metadata).
- `apply_schema()`, in an `upgrade()` of a revision of yours: brings the library's tables up
  to date, as `idempotency-asgi migrate` does, inside your migration's transaction.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from sqlalchemy import column, delete, func, insert, select, table, text

    from alembic import context, op
except ImportError as exc:  # pragma: no cover - tested in a subprocess without Alembic
    raise ImportError(
        "idempotency_asgi.alembic needs Alembic and SQLAlchemy: "
        "pip install 'idempotency-asgi[alembic]'"
    ) from exc

# The schema's one source (the revisions' statements), private to the package: what the
# library's tables are called is read from there, not repeated here.
from ._postgres.schema import HEAD, MIGRATION_LOCK_ID, REVISIONS, VERSION_TABLE

_CREATED = re.compile(r"\bCREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.IGNORECASE)

#: The library's tables: its key records, leases, the idempotent consumer's records, and
#: the version table of its own revisions (never your `alembic_version`).
TABLES: frozenset[str] = frozenset(
    {VERSION_TABLE}
    | {name for revision in REVISIONS for sql in revision.upgrade for name in _CREATED.findall(sql)}
)


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic's `include_name` hook: the library's tables are not even reflected."""
    return not (type_ == "table" and name in TABLES)


def include_object(
    object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic's `include_object` hook: nothing of the library's tables (the tables, their
    columns, indexes and constraints) is compared with your metadata."""
    if type_ == "table":
        return name not in TABLES
    table = getattr(object, "table", None)
    return getattr(table, "name", None) not in TABLES


#: Why apply_schema() refuses Alembic's offline mode.
OFFLINE = (
    "idempotency_asgi.alembic.apply_schema() cannot run in Alembic's offline mode "
    "(alembic upgrade --sql): which of idempotency-asgi's revisions to apply depends on the "
    "version the database holds, and an offline run does not read the database. Apply the "
    "library's schema apart from the script: run `idempotency-asgi migrate` against the "
    "database (before or after the script), or run this revision online"
)


def apply_schema() -> list[str]:
    """Bring the library's tables up to date from a revision of yours (`upgrade()`): the
    revisions `idempotency-asgi migrate` would apply, applied in your migration's
    transaction, recorded in the library's own version table (so either way can continue
    where the other stopped). Returns the library's revisions applied. Run it again, in a
    new revision of yours, after an upgrade of idempotency-asgi whose changelog says its
    schema changed.

    Not in Alembic's offline mode (`alembic upgrade --sql`): RuntimeError, saying to run
    `idempotency-asgi migrate` instead (see `OFFLINE`)."""
    if context.is_offline_mode():
        raise RuntimeError(OFFLINE)
    bind = op.get_bind()
    # Core constructs, not SQL text with binds: whatever driver the team's Alembic runs on.
    version = table(VERSION_TABLE, column("version_num"))
    # The same lock as `idempotency-asgi migrate`: a server migrating at startup waits.
    bind.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK_ID)))
    bind.execute(
        text(
            f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version_num varchar(32) NOT NULL,"
            f" CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
        )
    )
    current = bind.execute(select(version.c.version_num)).scalar()
    ids = [revision.id for revision in REVISIONS]
    if current is not None and current not in ids:
        raise RuntimeError(
            f"the database's idempotency-asgi schema is at revision {current!r}, which this "
            "version of idempotency-asgi does not know; upgrade the package"
        )
    start = 0 if current is None else ids.index(current) + 1
    applied = []
    for revision in REVISIONS[start:]:
        for statement in revision.upgrade:
            op.execute(statement)  # one statement per call: asyncpg runs no more
        applied.append(revision.id)
    if applied:
        bind.execute(delete(version))
        bind.execute(insert(version).values(version_num=HEAD))
    return applied


__all__ = ["TABLES", "apply_schema", "include_name", "include_object"]
