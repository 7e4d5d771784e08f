"""Create idempotency_processed_messages (the idempotent consumer's dedup records).

Revision ID: 0002
Revises: 0001
"""

from idempotency_asgi._postgres.schema import alembic_steps

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

upgrade, downgrade = alembic_steps(revision)
