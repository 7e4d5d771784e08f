"""Create idempotency_keys.

Revision ID: 0001
Revises:
"""

from idempotency_asgi._postgres.schema import alembic_steps

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

upgrade, downgrade = alembic_steps(revision)
