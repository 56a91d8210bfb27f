"""nodes.heartbeat_interval_s: the interval each agent was told, which scales with the cluster

Revision ID: 0012
Revises: 0010
Create Date: 2026-12-04 00:12:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL: the configured heartbeat_interval_s (what every agent was told before).
    op.add_column("nodes", sa.Column("heartbeat_interval_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "heartbeat_interval_s")
