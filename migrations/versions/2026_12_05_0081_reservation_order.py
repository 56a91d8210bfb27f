"""reservations.seq: the order reservations were made (a pass makes many at one created_at, and
the next pass keeps them in that order)

Revision ID: 0081
Revises: 0080
Create Date: 2026-12-05 00:00:01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0081"
down_revision = "0080"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reservations", sa.Column("seq", sa.BigInteger(), sa.Identity(), nullable=False))


def downgrade() -> None:
    op.drop_column("reservations", "seq")
