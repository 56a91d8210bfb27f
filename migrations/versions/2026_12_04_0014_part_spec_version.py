"""attempt_nodes.spec_version: a part's launch spec is versioned once, at allocation, so a heartbeat
or a long poll whose agent holds every spec reads one narrow row per attempt and builds no spec

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 00:14:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for parts allocated before: their version is computed when they are read, as before.
    op.add_column("attempt_nodes", sa.Column("spec_version", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("attempt_nodes", "spec_version")
