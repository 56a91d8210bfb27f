"""command jobs (issue 26 item 7): a job may bring its own command (argv), run once per node in
place of torchrun; NULL: torchrun runs its entrypoint

Revision ID: 0195_i26_command
Revises: i23_storage
Create Date: 2026-12-11 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0195_i26_command"
down_revision = "i23_storage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("command", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "command")
