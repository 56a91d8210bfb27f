"""checkpoints.shards_received: a counter of recorded shards, so a shard report costs O(its shards)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 00:11:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("shards_received", sa.Integer(), server_default=sa.text("0"),
                                           nullable=False))
    op.execute("UPDATE checkpoints SET shards_received = (SELECT count(*) FROM checkpoint_shards s "
               "WHERE s.checkpoint_id = checkpoints.id)")


def downgrade() -> None:
    op.drop_column("checkpoints", "shards_received")
