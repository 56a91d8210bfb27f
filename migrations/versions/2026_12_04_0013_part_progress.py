"""Progress lives on attempt parts: a status report writes only its own node's part, never the job
or the attempt row, so one job's nodes report at once (the job and attempt views derive progress)

Revision ID: 0013
Revises: 0031
Create Date: 2026-12-04 00:13:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0013"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempt_nodes", sa.Column("progress_step", sa.Integer(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("progress_loss", sa.Float(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("progress_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt_nodes", sa.Column("first_progress_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt_nodes", sa.Column("progress_metrics", postgresql.JSONB(astext_type=sa.Text()),
                                             nullable=True))
    # What the attempt and the job said goes to the attempt's node rank 0 (the views take the maximum).
    op.execute("""
        UPDATE attempt_nodes p SET progress_step = a.progress_step, first_progress_at = a.first_progress_at,
                                   progress_metrics = a.progress_metrics
        FROM attempts a WHERE p.attempt_id = a.id AND p.node_rank = 0
    """)
    op.execute("""
        UPDATE attempt_nodes p SET progress_loss = j.progress_loss, progress_at = j.progress_at
        FROM jobs j WHERE p.attempt_id = j.current_attempt_id AND p.node_rank = 0
          AND p.progress_step IS NOT DISTINCT FROM j.progress_step
    """)
    op.drop_column("attempts", "progress_step")
    op.drop_column("attempts", "first_progress_at")
    op.drop_column("attempts", "progress_metrics")
    op.drop_column("jobs", "progress_step")
    op.drop_column("jobs", "progress_loss")
    op.drop_column("jobs", "progress_at")


def downgrade() -> None:
    op.add_column("jobs", sa.Column("progress_at", postgresql.TIMESTAMP(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("progress_loss", sa.Float(), nullable=True))
    op.add_column("jobs", sa.Column("progress_step", sa.Integer(), nullable=True))
    op.add_column("attempts", sa.Column("first_progress_at", postgresql.TIMESTAMP(timezone=True), nullable=True))
    op.add_column("attempts", sa.Column("progress_step", sa.Integer(), nullable=True))
    op.add_column("attempts", sa.Column("progress_metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.execute("""
        UPDATE attempts a SET progress_step = p.step, first_progress_at = p.first
        FROM (SELECT attempt_id, max(progress_step) AS step, min(first_progress_at) AS first
              FROM attempt_nodes GROUP BY attempt_id) p
        WHERE p.attempt_id = a.id
    """)
    op.execute("""
        UPDATE attempts a SET progress_metrics = p.progress_metrics
        FROM (SELECT DISTINCT ON (attempt_id) attempt_id, progress_metrics FROM attempt_nodes
              WHERE progress_step IS NOT NULL
              ORDER BY attempt_id, progress_step DESC, progress_at DESC NULLS LAST) p
        WHERE p.attempt_id = a.id
    """)
    op.execute("""
        UPDATE jobs j SET progress_step = p.progress_step, progress_loss = p.progress_loss, progress_at = p.progress_at
        FROM (SELECT DISTINCT ON (a.job_id) a.job_id, n.progress_step, n.progress_loss, n.progress_at
              FROM attempt_nodes n JOIN attempts a ON a.id = n.attempt_id
              WHERE n.progress_step IS NOT NULL
              ORDER BY a.job_id, a.number DESC, n.progress_step DESC, n.progress_at DESC NULLS LAST) p
        WHERE p.job_id = j.id
    """)
    op.drop_column("attempt_nodes", "progress_metrics")
    op.drop_column("attempt_nodes", "first_progress_at")
    op.drop_column("attempt_nodes", "progress_at")
    op.drop_column("attempt_nodes", "progress_loss")
    op.drop_column("attempt_nodes", "progress_step")
