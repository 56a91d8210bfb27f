"""an index on nodes.token_hash: every agent request looks its node up by credential

Revision ID: 0010
Revises: 0004
Create Date: 2026-12-04 00:10:00
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Without it each heartbeat (one per node per second) scans the nodes table.
    op.create_index("ix_nodes_token_hash", "nodes", ["token_hash"])


def downgrade() -> None:
    op.drop_index("ix_nodes_token_hash", table_name="nodes")
