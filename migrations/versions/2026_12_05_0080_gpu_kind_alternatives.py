"""jobs.gpu_kinds: the GPU kinds a job accepts (it was one, jobs.gpu_kind); attempts.gpu_kind: the
kind an attempt got

Revision ID: 0080
Revises: 0014
Create Date: 2026-12-05 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0080"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("gpu_kinds", postgresql.ARRAY(sa.String(length=128)), nullable=True))
    op.execute("UPDATE jobs SET gpu_kinds = ARRAY[gpu_kind] WHERE gpu_kind IS NOT NULL")
    op.drop_column("jobs", "gpu_kind")
    op.add_column("attempts", sa.Column("gpu_kind", sa.String(length=128), nullable=True))
    # The kind of the GPUs each earlier attempt held (a gang is of one kind).
    op.execute(
        "UPDATE attempts SET gpu_kind = (SELECT g.kind FROM attempt_nodes p JOIN gpus g"
        " ON g.node_id = p.node_id AND g.index = p.gpu_indices[1] WHERE p.attempt_id = attempts.id LIMIT 1)"
    )


def downgrade() -> None:
    op.drop_column("attempts", "gpu_kind")
    op.add_column("jobs", sa.Column("gpu_kind", sa.String(length=128), nullable=True))
    # A job that accepted several kinds keeps the first: the old schema could name only one.
    op.execute("UPDATE jobs SET gpu_kind = gpu_kinds[1] WHERE gpu_kinds IS NOT NULL")
    op.drop_column("jobs", "gpu_kinds")
