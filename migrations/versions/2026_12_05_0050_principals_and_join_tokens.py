"""principals, api_tokens, join_tokens; tenants.max_priority; jobs indexed by tenant and principal

Revision ID: 0050
Revises: 0020
Create Date: 2026-12-05 00:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0050"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "principals",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('admin', 'operator', 'member', 'viewer')", name=op.f("ck_principals_role_known")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_principals")),
        sa.UniqueConstraint("name", name=op.f("uq_principals_name")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("principal_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("description", sa.String(length=256), server_default="", nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["principal_id"], ["principals.id"], name=op.f("fk_api_tokens_principal_id_principals"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_index(op.f("ix_api_tokens_principal_id"), "api_tokens", ["principal_id"], unique=False)
    op.create_table(
        "join_tokens",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("node_name", sa.String(length=128), nullable=True),
        sa.Column("max_uses", sa.Integer(), nullable=True),
        sa.Column("uses", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("description", sa.String(length=256), server_default="", nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("max_uses IS NULL OR max_uses >= 1", name=op.f("ck_join_tokens_max_uses_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_join_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_join_tokens_token_hash")),
    )
    op.add_column("tenants", sa.Column("max_priority", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant", "created_at"], unique=False)
    op.create_index("ix_jobs_principal_created", "jobs", ["principal", "created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_principal_created", table_name="jobs")
    op.drop_index("ix_jobs_tenant_created", table_name="jobs")
    op.drop_column("tenants", "max_priority")
    op.drop_table("join_tokens")
    op.drop_index(op.f("ix_api_tokens_principal_id"), table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("principals")
