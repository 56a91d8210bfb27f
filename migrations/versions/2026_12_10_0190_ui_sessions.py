"""dashboard sessions and token parents: the dashboard's cookie holds a session secret of its own
(revoked at logout), and a token made by a token records its parent (it expires no later)

Revision ID: 0190
Revises: 0180
Create Date: 2026-12-10 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0190"
down_revision = "0180"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("parent_id", postgresql.UUID(as_uuid=True), nullable=True))
    op.create_foreign_key("fk_api_tokens_parent_id_api_tokens", "api_tokens", "api_tokens", ["parent_id"], ["id"],
                          ondelete="SET NULL")
    op.create_index("ix_api_tokens_parent_id", "api_tokens", ["parent_id"])
    op.create_table(
        "ui_sessions",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("token_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("admin_token_hash", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_ui_sessions"),
        sa.UniqueConstraint("secret_hash", name="uq_ui_sessions_secret_hash"),
        sa.ForeignKeyConstraint(["token_id"], ["api_tokens.id"], name="fk_ui_sessions_token_id_api_tokens",
                                ondelete="CASCADE"),
    )
    op.create_index("ix_ui_sessions_token_id", "ui_sessions", ["token_id"])


def downgrade() -> None:
    op.drop_index("ix_ui_sessions_token_id", table_name="ui_sessions")
    op.drop_table("ui_sessions")
    op.drop_index("ix_api_tokens_parent_id", table_name="api_tokens")
    op.drop_constraint("fk_api_tokens_parent_id_api_tokens", "api_tokens", type_="foreignkey")
    op.drop_column("api_tokens", "parent_id")
