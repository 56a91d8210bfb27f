"""attempt_nodes.received_at and initialized_at: the wake-up and rendezvous boundaries of a recovery

Revision ID: 0170
Revises: 0040
Create Date: 2026-12-05 03:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0170"
down_revision = "0040"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempt_nodes", sa.Column("received_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt_nodes", sa.Column("initialized_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("attempt_nodes", "initialized_at")
    op.drop_column("attempt_nodes", "received_at")
