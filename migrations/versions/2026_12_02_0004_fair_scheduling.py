"""fair scheduling: tenants, reservations (idle-cost accounting), node drain and operator labels;
the gang check counts each attempt once per commit

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


# The gang check (0001) fires at commit once per lease and counts every active lease of the
# lease's attempt: quadratic in the gang size (a 128-GPU gang: 128 x 128 rows). An attempt's
# leases are inserted together, so its deferred checks come up one after another: count once per
# attempt per firing batch. The mark carries the firing statement's timestamp, so checks fired
# earlier in the transaction (SET CONSTRAINTS ... IMMEDIATE) never stand in for the ones at commit.
GANG_FUNCTION_ONCE_PER_ATTEMPT = """
CREATE OR REPLACE FUNCTION trainyard_check_gang_complete() RETURNS trigger AS $$
DECLARE
    want integer;
    have integer;
    mark text := NEW.attempt_id::text || '@' || statement_timestamp()::text;
BEGIN
    IF current_setting('trainyard.gang_checked', true) = mark THEN
        RETURN NULL;
    END IF;
    SELECT num_gpus INTO want FROM attempts WHERE id = NEW.attempt_id;
    SELECT count(*) INTO have FROM gpu_leases
        WHERE attempt_id = NEW.attempt_id AND released_at IS NULL;
    IF have <> want THEN
        RAISE EXCEPTION 'partial gang allocation: attempt % holds % of % GPUs', NEW.attempt_id, have, want
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    PERFORM set_config('trainyard.gang_checked', mark, true);
    RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""

GANG_FUNCTION_0001 = """
CREATE OR REPLACE FUNCTION trainyard_check_gang_complete() RETURNS trigger AS $$
DECLARE
    want integer;
    have integer;
BEGIN
    SELECT num_gpus INTO want FROM attempts WHERE id = NEW.attempt_id;
    SELECT count(*) INTO have FROM gpu_leases
        WHERE attempt_id = NEW.attempt_id AND released_at IS NULL;
    IF have <> want THEN
        RAISE EXCEPTION 'partial gang allocation: attempt % holds % of % GPUs', NEW.attempt_id, have, want
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("weight", sa.Float(), server_default=sa.text("1"), nullable=False),
        sa.Column("gpu_quota", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("weight > 0", name=op.f("ck_tenants_weight_positive")),
        sa.CheckConstraint("gpu_quota IS NULL OR gpu_quota >= 0", name=op.f("ck_tenants_quota_not_negative")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenants")),
    )
    op.create_table(
        "reservations",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("job_id", sa.UUID(), nullable=True),
        sa.Column("gpu_kind", sa.String(length=128), nullable=True),
        sa.Column("node_ids", postgresql.ARRAY(sa.UUID()), nullable=False),
        sa.Column("earliest_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("first_earliest_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("held_gpus", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("idle_gpu_seconds", sa.Float(), server_default=sa.text("0"), nullable=False),
        sa.Column("served", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_reservations_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reservations")),
    )
    op.create_index(op.f("ix_reservations_job_id"), "reservations", ["job_id"], unique=False)
    op.create_index("uq_reservations_active_job", "reservations", ["job_id"], unique=True,
                    postgresql_where=sa.text("ended_at IS NULL AND kind = 'job'"))
    op.create_index("uq_reservations_active_reserve", "reservations", ["gpu_kind"], unique=True,
                    postgresql_where=sa.text("ended_at IS NULL AND kind = 'recovery-reserve'"))
    op.add_column("nodes", sa.Column("draining", sa.Boolean(), server_default=sa.text("false"), nullable=False))
    op.add_column("nodes", sa.Column("label_overrides", postgresql.JSONB(astext_type=sa.Text()),
                                     server_default=sa.text("'{}'::jsonb"), nullable=False))
    op.create_check_constraint(op.f("ck_nodes_drain_unschedulable"), "nodes", "NOT (draining AND schedulable)")
    op.execute(GANG_FUNCTION_ONCE_PER_ATTEMPT)


def downgrade() -> None:
    op.execute(GANG_FUNCTION_0001)
    op.drop_constraint(op.f("ck_nodes_drain_unschedulable"), "nodes", type_="check")
    op.drop_column("nodes", "label_overrides")
    op.drop_column("nodes", "draining")
    op.drop_index("uq_reservations_active_reserve", table_name="reservations")
    op.drop_index("uq_reservations_active_job", table_name="reservations")
    op.drop_index(op.f("ix_reservations_job_id"), table_name="reservations")
    op.drop_table("reservations")
    op.drop_table("tenants")
