"""In-process restart of healthy ranks: a job may be restartable, and a part may adopt the parked
part of an earlier attempt on its node (docs/architecture.md, "In-process restart of healthy ranks")

Revision ID: 0160
Revises: 0150
Create Date: 2026-12-08 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0160"
down_revision = "0150"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("restartable", sa.Boolean(), server_default=sa.text("false"), nullable=False))
    op.add_column("attempt_nodes", sa.Column("adopts_attempt_id", postgresql.UUID(as_uuid=True), nullable=True))
    op.create_foreign_key(op.f("fk_attempt_nodes_adopts_attempt_id_attempts"), "attempt_nodes", "attempts",
                          ["adopts_attempt_id"], ["id"], ondelete="CASCADE")


def downgrade() -> None:
    op.drop_constraint(op.f("fk_attempt_nodes_adopts_attempt_id_attempts"), "attempt_nodes", type_="foreignkey")
    op.drop_column("attempt_nodes", "adopts_attempt_id")
    op.drop_column("jobs", "restartable")
