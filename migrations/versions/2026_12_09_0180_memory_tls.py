"""memory tier over TLS: whether a node's memory port speaks TLS (its agent has a node certificate)

Revision ID: 0180
Revises: 0160
Create Date: 2026-12-09 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0180"
down_revision = "0160"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("memory_tls", sa.Boolean(), server_default=sa.text("false"), nullable=False))


def downgrade() -> None:
    op.drop_column("nodes", "memory_tls")
