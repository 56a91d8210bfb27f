"""memory tier: each node's memory port, each job's memory secret, each part's peer and sources

Revision ID: 0150
Revises: 0170
Create Date: 2026-12-07 01:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0150"
down_revision = "0170"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("memory_port", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("memory_secret", sa.String(length=64), nullable=True))
    op.add_column("attempt_nodes", sa.Column("memory", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("attempt_nodes", "memory")
    op.drop_column("jobs", "memory_secret")
    op.drop_column("nodes", "memory_port")
