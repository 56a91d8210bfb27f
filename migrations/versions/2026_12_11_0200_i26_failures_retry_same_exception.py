"""jobs.retry_same_exception (issue 26): an exception raised again at the same step as in the
attempt before fails the job unless the job asks to retry it

Revision ID: 0200_i26_failures
Revises: 0190
Create Date: 2026-12-11 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0200_i26_failures"
down_revision = "0190"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("retry_same_exception", sa.Boolean(), server_default=sa.text("false"),
                                    nullable=False))


def downgrade() -> None:
    op.drop_column("jobs", "retry_same_exception")
