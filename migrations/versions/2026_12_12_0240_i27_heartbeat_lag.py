"""nodes.heartbeat_lag_s (issue 27): how long the node's last heartbeat waited in its replica before it
was recorded; every replica's monitor waits that much longer before declaring any node lost

Revision ID: 0240_i27_lag
Revises: 0195_i26_command
Create Date: 2026-12-12 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0240_i27_lag"
down_revision = "0195_i26_command"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("heartbeat_lag_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "heartbeat_lag_s")
