"""A job's requirements (installed by each agent into a cached virtualenv per content hash) and the
kind of a node part's error when its agent knows it (a requirements install that fails: start_error)

Revision ID: 0120
Revises: 0100
Create Date: 2026-12-07 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0120"
down_revision = "0100"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("requirements", sa.Text(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("error_kind", sa.String(length=32), nullable=True))


def downgrade() -> None:
    op.drop_column("attempt_nodes", "error_kind")
    op.drop_column("jobs", "requirements")
