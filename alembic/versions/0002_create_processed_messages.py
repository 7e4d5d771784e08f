"""Create idempotency_processed_messages (the idempotent consumer's dedup records).

Revision ID: 0002
Revises: 0001
"""

from alembic import op
from idempotency_asgi.schema import REVISIONS

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_REVISION = next(r for r in REVISIONS if r.id == revision)


def upgrade() -> None:
    for statement in _REVISION.upgrade:
        op.execute(statement)


def downgrade() -> None:
    for statement in _REVISION.downgrade:
        op.execute(statement)
