"""attempt_parts.follows_part_id: the part of the job's previous attempt on the same node whose GPU
leases this part was given while that part's processes were still stopping (issue 27: a recovery
does not wait for every node's release)

Revision ID: 0260_i27_follows_part
Revises: 0250_attempt_parts
Create Date: 2026-12-14 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0260_i27_follows_part"
down_revision = "0250_attempt_parts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempt_parts", sa.Column("follows_part_id", postgresql.UUID(as_uuid=True), nullable=True))
    op.create_foreign_key(op.f("fk_attempt_parts_follows_part_id_attempt_parts"), "attempt_parts", "attempt_parts",
                          ["follows_part_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    op.drop_constraint(op.f("fk_attempt_parts_follows_part_id_attempt_parts"), "attempt_parts", type_="foreignkey")
    op.drop_column("attempt_parts", "follows_part_id")
