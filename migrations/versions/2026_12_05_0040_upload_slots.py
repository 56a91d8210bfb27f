"""upload_slots: checkpoint upload slots (leases on the shared links); each shard's upload wait

Revision ID: 0040
Revises: 0120
Create Date: 2026-12-05 00:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0040"
down_revision = "0120"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "upload_slots",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("seq", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("attempt_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("node_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rate_bytes_per_s", sa.BigInteger(), nullable=True),
        sa.Column("ok", sa.Boolean(), nullable=True),
        sa.Column("uploaded_bytes", sa.BigInteger(), nullable=True),
        sa.Column("upload_s", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_upload_slots_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"], name=op.f("fk_upload_slots_attempt_id_attempts"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_upload_slots_node_id_nodes"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upload_slots")),
    )
    # One open slot per (attempt, rank, step): asking again polls or renews it.
    op.create_index("uq_upload_slots_open", "upload_slots", ["attempt_id", "rank", "step"], unique=True,
                    postgresql_where=sa.text("state IN ('waiting', 'granted')"))
    op.create_index("ix_upload_slots_waiting_seq", "upload_slots", ["seq"],
                    postgresql_where=sa.text("state = 'waiting'"))
    op.create_index("ix_upload_slots_granted_node", "upload_slots", ["node_id"],
                    postgresql_where=sa.text("state = 'granted'"))
    op.create_index("ix_upload_slots_job_id_seq", "upload_slots", ["job_id", "seq"])
    op.add_column("checkpoint_shards", sa.Column("upload_wait_s", sa.Float(), nullable=True))
    op.add_column("checkpoint_shards", sa.Column("upload_s", sa.Float(), nullable=True))
    op.add_column("checkpoint_shards", sa.Column("upload_slot", sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column("checkpoint_shards", "upload_slot")
    op.drop_column("checkpoint_shards", "upload_s")
    op.drop_column("checkpoint_shards", "upload_wait_s")
    op.drop_index("ix_upload_slots_job_id_seq", table_name="upload_slots")
    op.drop_index("ix_upload_slots_granted_node", table_name="upload_slots")
    op.drop_index("ix_upload_slots_waiting_seq", table_name="upload_slots")
    op.drop_index("uq_upload_slots_open", table_name="upload_slots")
    op.drop_table("upload_slots")
