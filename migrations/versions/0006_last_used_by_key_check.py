"""``kiln_settle`` no longer writes ``api_keys.last_used_at``.

The key check writes it now (``gateway/auth.py``), at most once per key per minute in each
worker, and also for requests refused at admission and for calls other than chat completions;
the settlement's write was redundant. Postgres: installs the new ``kiln_settle``
(``gateway/ledger/postgres.py``); SQLite's ledger is Python. Downgrade installs the previous
function again (the same text plus that write).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_HELD = "                  held_nanos = k.held_nanos - t.key_hold\n"
_HELD_AND_LAST_USED = """                  held_nanos = k.held_nanos - t.key_hold,
                  last_used_at = CASE WHEN k.last_used_at IS NULL
                                        OR k.last_used_at < v_now - interval '1 minute'
                                      THEN v_now ELSE k.last_used_at END
"""


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        assert SETTLE.count(_HELD) == 1, "kiln_settle changed: write this downgrade again"
        op.execute(SETTLE.replace(_HELD, _HELD_AND_LAST_USED))
