"""The idempotency-asgi tables.

Revision ID: 0002
Revises: 0001
"""

from idempotency_asgi.alembic import apply_schema

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    apply_schema()  # (1)!


def downgrade() -> None:
    pass  # (2)!
