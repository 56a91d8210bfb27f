"""Goodput: watchdogs (hang, stragglers), checkpoint costs, the auto checkpoint interval

Revision ID: 0090
Revises: 0081
Create Date: 2026-12-06 00:09:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0090"
down_revision = "0081"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for every row written before: no watchdog override, no measurement yet.
    op.add_column("jobs", sa.Column("watchdog", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("jobs", sa.Column("checkpoint_auto", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("attempts", sa.Column("hung_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempts", sa.Column("checkpoint_interval_steps", sa.Integer(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("step_advanced_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt_nodes", sa.Column("step_time_s", sa.Float(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("ranks", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("attempt_nodes", sa.Column("ranks_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt_nodes", sa.Column("straggler_rank", sa.Integer(), nullable=True))
    op.add_column("attempt_nodes", sa.Column("straggler_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt_nodes", sa.Column("straggler_named_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("checkpoints", sa.Column("blocking_s", sa.Float(), nullable=True))
    op.add_column("checkpoints", sa.Column("background_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("checkpoints", "background_s")
    op.drop_column("checkpoints", "blocking_s")
    for column in ("straggler_named_at", "straggler_since", "straggler_rank", "ranks_at", "ranks", "step_time_s",
                   "step_advanced_at"):
        op.drop_column("attempt_nodes", column)
    for column in ("checkpoint_interval_steps", "hung_since"):
        op.drop_column("attempts", column)
    op.drop_column("jobs", "checkpoint_auto")
    op.drop_column("jobs", "watchdog")
