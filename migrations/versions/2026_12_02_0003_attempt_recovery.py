"""attempt recovery facts: the last step an attempt reported and the node blamed for its failure

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("progress_step", sa.Integer(), nullable=True))
    op.add_column("attempts", sa.Column("failed_node_id", sa.UUID(), nullable=True))
    op.create_foreign_key(
        op.f("fk_attempts_failed_node_id_nodes"), "attempts", "nodes", ["failed_node_id"], ["id"], ondelete="SET NULL"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("fk_attempts_failed_node_id_nodes"), "attempts", type_="foreignkey")
    op.drop_column("attempts", "failed_node_id")
    op.drop_column("attempts", "progress_step")
