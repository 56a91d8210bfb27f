"""checkpoint usability and lineage: restore plans reference manifests (sha256, size) instead of
carrying them; an attempt records the checkpoint it restored from (the lineage chain)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 01:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("manifest_sha256", sa.String(length=64), nullable=True))
    op.add_column("checkpoints", sa.Column("manifest_size_bytes", sa.BigInteger(), nullable=True))
    op.add_column("attempts", sa.Column("restored_from_checkpoint_id", postgresql.UUID(as_uuid=True), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "restored_from_checkpoint_id")
    op.drop_column("checkpoints", "manifest_size_bytes")
    op.drop_column("checkpoints", "manifest_sha256")
