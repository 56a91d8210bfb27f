"""Progress a person can read (total steps and a smoothed step rate on each attempt part, a sampled
history for charts) and failed attempts and workers classified by cause; a job's shipped code and
interpreter

Revision ID: 0100
Revises: 0090
Create Date: 2026-12-06 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0100"
down_revision = "0090"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempt_nodes", sa.Column("progress_total", sa.Integer(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("progress_rate", sa.Float(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("progress_sampled_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("code", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("jobs", sa.Column("python", sa.Text(), nullable=True))
    op.add_column("attempts", sa.Column("failure_kind", sa.String(length=32), nullable=True))
    op.add_column("workers", sa.Column("exit_cause", sa.String(length=32), nullable=True))
    op.add_column("workers", sa.Column("exit_message", sa.Text(), nullable=True))
    op.create_table(
        "progress_samples",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.UUID(), nullable=False),
        sa.Column("attempt_number", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("steps_per_s", sa.Float(), nullable=True),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"),
                  nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_progress_samples_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress_samples")),
    )
    op.create_index("ix_progress_samples_job_id_id", "progress_samples", ["job_id", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_progress_samples_job_id_id", table_name="progress_samples")
    op.drop_table("progress_samples")
    op.drop_column("workers", "exit_message")
    op.drop_column("workers", "exit_cause")
    op.drop_column("attempts", "failure_kind")
    op.drop_column("jobs", "python")
    op.drop_column("jobs", "code")
    op.drop_column("attempt_nodes", "progress_sampled_at")
    op.drop_column("attempt_nodes", "progress_rate")
    op.drop_column("attempt_nodes", "progress_total")
