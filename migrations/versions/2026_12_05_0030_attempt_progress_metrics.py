"""attempts.progress_metrics: the metrics of an attempt's last progress report (the measured
compute/communication split of its steps), shown in the job view

Revision ID: 0030
Revises: 0050
Create Date: 2026-12-04 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0030"
down_revision = "0050"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("progress_metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "progress_metrics")
