"""A rendezvous port is unique among active attempts on its host, not cluster-wide

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-05 00:31:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

ACTIVE = sa.text("state IN ('starting', 'running', 'stopping')")


def upgrade() -> None:
    op.drop_index("uq_attempts_active_rdzv_port", table_name="attempts", postgresql_where=ACTIVE)
    op.create_index("uq_attempts_active_rdzv_port", "attempts", ["rdzv_host", "rdzv_port"], unique=True,
                    postgresql_where=ACTIVE)


def downgrade() -> None:
    op.drop_index("uq_attempts_active_rdzv_port", table_name="attempts", postgresql_where=ACTIVE)
    op.create_index("uq_attempts_active_rdzv_port", "attempts", ["rdzv_port"], unique=True, postgresql_where=ACTIVE)
