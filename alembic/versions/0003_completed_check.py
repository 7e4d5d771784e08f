"""A row of idempotency_keys is completed exactly when it has a completion time.

Revision ID: 0003
Revises: 0002
"""

from idempotency_asgi._postgres.schema import alembic_steps

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

upgrade, downgrade = alembic_steps(revision)
