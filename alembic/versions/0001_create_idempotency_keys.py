"""Create idempotency_keys.

Revision ID: 0001
Revises:
"""

from alembic import op
from idempotency_asgi.schema import REVISIONS

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_REVISION = next(r for r in REVISIONS if r.id == revision)


def upgrade() -> None:
    for statement in _REVISION.upgrade:
        op.execute(statement)


def downgrade() -> None:
    for statement in _REVISION.downgrade:
        op.execute(statement)
