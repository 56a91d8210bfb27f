"""agent instance fencing: nodes.agent_epoch counts registrations; a credential of an older one is
refused as stale (409), not unknown (401)

Revision ID: 0007
Revises: 0004
Create Date: 2026-12-04 00:07:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("agent_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    op.drop_column("nodes", "agent_epoch")
