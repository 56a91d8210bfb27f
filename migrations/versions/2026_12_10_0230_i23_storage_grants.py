"""storage put grants (issue 23 finding 7, branch i23-storage): every object a worker was granted
to create, so that one never reported is deleted once its attempt ends

Revision ID: i23_storage
Revises: 0200_i26_failures
Create Date: 2026-12-10 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "i23_storage"
down_revision = "0200_i26_failures"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "storage_put_grants",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("attempt_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("upload_id", sa.Text(), nullable=True),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_storage_put_grants_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"],
                                name=op.f("fk_storage_put_grants_attempt_id_attempts"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_storage_put_grants")),
        sa.UniqueConstraint("key", name=op.f("uq_storage_put_grants_key")),
    )
    op.create_index("ix_storage_put_grants_job_id", "storage_put_grants", ["job_id"])
    op.create_index("ix_storage_put_grants_attempt_step", "storage_put_grants", ["attempt_id", "step"])


def downgrade() -> None:
    op.drop_table("storage_put_grants")
