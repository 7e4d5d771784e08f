"""The atomic mode's functions: its claim and its record, each one call in a round trip.

Revision ID: 0006
Revises: 0005
"""

from idempotency_asgi._postgres.schema import alembic_steps

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

upgrade, downgrade = alembic_steps(revision)
