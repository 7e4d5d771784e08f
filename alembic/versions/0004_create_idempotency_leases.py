"""Lease renewals and waiters' marks in a table of their own, off the key row.

Revision ID: 0004
Revises: 0003
"""

from idempotency_asgi._postgres.schema import alembic_steps

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

upgrade, downgrade = alembic_steps(revision)
