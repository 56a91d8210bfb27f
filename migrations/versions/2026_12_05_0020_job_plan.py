"""jobs.model, jobs.layout, jobs.plan: the model a job trains, the layout its workers apply, its plan

Revision ID: 0020
Revises: 0012
Create Date: 2026-12-05 00:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0020"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for every job submitted before: no model block, plain DDP, no plan.
    op.add_column("jobs", sa.Column("model", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("jobs", sa.Column("layout", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("jobs", sa.Column("plan", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "plan")
    op.drop_column("jobs", "layout")
    op.drop_column("jobs", "model")
