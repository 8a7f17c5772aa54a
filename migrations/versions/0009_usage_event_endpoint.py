"""Each usage event records the API its client called (``chat``, ``messages``, ``responses``,
``completions``, ``embeddings``: the codec's name, gateway/dialects/); every event before this
revision was a chat completion.

Adding a column with a constant default is a change of the catalog only on Postgres 11 and
later (no table rewrite) and on SQLite. Postgres: ``kiln_admit`` gains ``p_endpoint`` (default
``'chat'``, so a caller of the old nine arguments still works) and ``kiln_admit_batch`` passes
each request's; both installed from ``gateway/ledger/postgres.py``. Downgrade puts back the
installed functions without this change.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import ADMIT, ADMIT_BATCH

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

OLD_ADMIT = ("kiln_admit(text, integer, integer, text, boolean, bigint, integer, "
             "double precision, boolean)")
NEW_ADMIT = OLD_ADMIT[:-1] + ", text)"
# The installed functions before this revision differed by these hunks (new, old).
ADMIT_CHANGES = (
    ("p_key_checks boolean, p_endpoint text DEFAULT 'chat'::text)", "p_key_checks boolean)"),
    ("started_at, endpoint)", "started_at)"),
    ("p_hold, v_now, p_endpoint);", "p_hold, v_now);"),
)
BATCH_CHANGE = ("""(r.a->>'key_checks')::boolean,
                                      COALESCE(r.a->>'endpoint', 'chat')) k;""",
                """(r.a->>'key_checks')::boolean) k;""")


def upgrade():
    # Its locks are waited for a moment at most, or it is tried again (migrations/env.py).
    # A plain ADD COLUMN on both (SQLite's batch mode would rebuild the table that in_flight
    # refers to).
    op.add_column("usage_events", sa.Column("endpoint", sa.String(16), nullable=False,
                                            server_default="chat"))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS kiln_admit_batch(jsonb)")
        op.execute(f"DROP FUNCTION IF EXISTS {OLD_ADMIT}")
        op.execute(ADMIT)
        op.execute(ADMIT_BATCH)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        admit = _installed(NEW_ADMIT, ADMIT_CHANGES)
        batch = _installed("kiln_admit_batch(jsonb)", (BATCH_CHANGE,))
        op.execute("DROP FUNCTION kiln_admit_batch(jsonb)")
        op.execute(f"DROP FUNCTION {NEW_ADMIT}")
        op.execute(admit)
        op.execute(batch)
        op.drop_column("usage_events", "endpoint")
    else:  # SQLite 3.35 and later drop a column in place
        op.execute("ALTER TABLE usage_events DROP COLUMN endpoint")


def _installed(signature, changes):
    """The installed function's definition with ``changes`` undone."""
    text = op.get_bind().execute(sa.text(
        f"SELECT pg_get_functiondef('{signature}'::regprocedure)")).scalar_one()
    for new, old in changes:
        if text.count(new) != 1:
            raise RuntimeError(f"{signature} changed since 0009: write this downgrade again")
        text = text.replace(new, old)
    return text
