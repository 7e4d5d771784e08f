"""Why a key is held in flight (an unknown outcome, a transaction the handler ended, a lost
answer): the column operators' `held`, `settle` and `release` read.

Revision ID: 0005
Revises: 0004
"""

from idempotency_asgi._postgres.schema import alembic_steps

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

upgrade, downgrade = alembic_steps(revision)
