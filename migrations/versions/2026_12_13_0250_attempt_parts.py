"""attempt_nodes -> attempt_parts and workers.attempt_node_id -> attempt_part_id: one name per
concept (a node's share of an attempt is a part), with every constraint and index whose name
carries the old name

Revision ID: 0250_attempt_parts
Revises: 0240_i27_lag
Create Date: 2026-12-13 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0250_attempt_parts"
down_revision = "0240_i27_lag"
branch_labels = None
depends_on = None


def _rename_table(old: str, new: str) -> None:
    op.rename_table(old, new)
    _rename(old, new)


def _rename(old: str, new: str) -> None:
    """Rename each constraint (of any table: foreign keys point at this one) and each index whose
    name holds ``old``. Names come from the catalog, so none is missed or guessed."""
    bind = op.get_bind()
    constraints = bind.execute(sa.text(
        "SELECT c.conrelid::regclass::text, c.conname FROM pg_constraint c "
        "JOIN pg_namespace n ON n.oid = c.connamespace "
        "WHERE n.nspname = current_schema() AND strpos(c.conname, :old) > 0"), {"old": old}).all()
    quote = bind.dialect.identifier_preparer.quote
    renamed = set()
    for table, name in constraints:  # regclass::text is quoted where it must be
        op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {quote(name)} TO {quote(name.replace(old, new))}")
        renamed.add(name)  # a primary key or unique constraint renames its index with it
    indexes = bind.execute(sa.text(
        "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() AND strpos(indexname, :old) > 0"),
        {"old": old}).scalars().all()
    for name in indexes:
        if name not in renamed:
            op.execute(f"ALTER INDEX {quote(name)} RENAME TO {quote(name.replace(old, new))}")


def upgrade() -> None:
    op.alter_column("workers", "attempt_node_id", new_column_name="attempt_part_id")
    _rename("attempt_node_id", "attempt_part_id")  # the workers' index and foreign key
    _rename_table("attempt_nodes", "attempt_parts")


def downgrade() -> None:
    op.alter_column("workers", "attempt_part_id", new_column_name="attempt_node_id")
    _rename_table("attempt_parts", "attempt_nodes")
    _rename("attempt_part_id", "attempt_node_id")
