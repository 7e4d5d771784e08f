"""idempotency_asgi.alembic in a team's own Alembic project, run as a team runs it (see
tests/alembic_project.py; the project as the documentation makes it is in
tests/test_docs_snippets.py)."""

from __future__ import annotations

import asyncpg
import pytest

from tests.alembic_project import SNIPPETS, Project
from tests.helpers import fresh_database


async def test_apply_schema_refuses_alembics_offline_mode_and_says_what_to_run(schema, tmp_path):
    # `alembic upgrade --sql` writes a script without reading the database: which of the
    # library's revisions to apply depends on the version the database holds, so
    # apply_schema() cannot know them, and says so rather than failing on a missing result.
    async with fresh_database(schema) as dsn:
        project = Project(tmp_path, dsn)
        project.autogenerate("0001", "payments")
        project.add_revision("0002_idempotency.py", (SNIPPETS / "alembic_revision.py").read_text())
        before = await tables(dsn)
        with pytest.raises(AssertionError) as failed:
            project.run("upgrade", "head", "--sql")
        said = str(failed.value)
        assert "offline mode" in said and "idempotency-asgi migrate" in said, said
        assert "AttributeError" not in said, said
        assert await tables(dsn) == before  # an offline run touches nothing
        assert not any(name.startswith("idempotency_") for name in before)
        # Online, the same revision applies the library's schema.
        project.run("upgrade", "head")
        conn = await asyncpg.connect(dsn)
        try:
            version = await conn.fetchval("SELECT version_num FROM idempotency_asgi_version")
        finally:
            await conn.close()
        assert version is not None


async def tables(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
    finally:
        await conn.close()
    return [row["tablename"] for row in rows]
