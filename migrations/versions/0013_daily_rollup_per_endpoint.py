"""The daily rollup (``usage_daily``, behind ``GET /v1/activity``) is kept per endpoint too: one
row per org, UTC day, model, key and API (``chat``, ``messages``, ``responses``,
``completions``, ``embeddings``; usage_events.endpoint, 0009). Every row before it was chat's.

Postgres: the column's constant default changes only the catalog; the primary key is rebuilt
on the rollup (a row per org, day, model and key: small), under a moment's lock; ``kiln_settle``
(``gateway/ledger/postgres.py``) rolls each event up under its endpoint. SQLite: the rollup
table is rebuilt (nothing refers to it). Downgrade adds each day's rows of other endpoints into
chat's, so no request or cost leaves the rollup, and puts back the function without this
change.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""
import contextlib
import warnings

import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

KEY = ["org_id", "day", "model", "api_key_id"]
# The installed kiln_settle before this revision differed by these hunks (new, old).
CHANGES = (
    ("e.api_key_id, e.endpoint, e.hold_nanos", "e.api_key_id, e.hold_nanos"),
    ("""  daily AS (INSERT INTO usage_daily AS u (org_id, day, model, api_key_id, endpoint, requests,
                                          errors, prompt_tokens, cached_tokens,
                                          completion_tokens, cost_nanos)
            SELECT d.org_id, CAST(d.began AT TIME ZONE 'UTC' AS date), d.model, d.api_key_id,
                   d.endpoint,""",
     """  daily AS (INSERT INTO usage_daily AS u (org_id, day, model, api_key_id, requests, errors,
                                          prompt_tokens, cached_tokens, completion_tokens,
                                          cost_nanos)
            SELECT d.org_id, CAST(d.began AT TIME ZONE 'UTC' AS date), d.model, d.api_key_id,"""),
    ("""              FROM d GROUP BY 1, 2, 3, 4, 5
            ON CONFLICT (org_id, day, model, api_key_id, endpoint) DO UPDATE""",
     """              FROM d GROUP BY 1, 2, 3, 4
            ON CONFLICT (org_id, day, model, api_key_id) DO UPDATE"""),
)
SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
        "cost_nanos")
# Downgrade: the other endpoints' rows added into chat's row of the same day, model and key.
FOLD = f"""INSERT INTO usage_daily ({", ".join(KEY)}, endpoint, {", ".join(SUMS)})
SELECT {", ".join(KEY)}, 'chat', {", ".join(f"SUM({c})" for c in SUMS)}
  FROM usage_daily WHERE endpoint <> 'chat' GROUP BY {", ".join(KEY)}
ON CONFLICT ({", ".join(KEY)}, endpoint) DO UPDATE
   SET {", ".join(f"{c} = usage_daily.{c} + EXCLUDED.{c}" for c in SUMS)}"""


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        # A moment's lock, or tried again (migrations/env.py).
        op.add_column("usage_daily", sa.Column("endpoint", sa.String(16), nullable=False,
                                               server_default="chat"))
        op.execute("ALTER TABLE usage_daily DROP CONSTRAINT pk_usage_daily, "
                   "ADD CONSTRAINT pk_usage_daily PRIMARY KEY "
                   "(org_id, day, model, api_key_id, endpoint)")
        op.execute(SETTLE)
        return
    with _rebuild() as batch:
        batch.add_column(sa.Column("endpoint", sa.String(16), nullable=False,
                                   server_default="chat"))
        batch.create_primary_key("pk_usage_daily", [*KEY, "endpoint"])


def downgrade():
    op.execute(FOLD)  # SQLite 3.24 and later, and Postgres, both take ON CONFLICT
    op.execute("DELETE FROM usage_daily WHERE endpoint <> 'chat'")
    if op.get_bind().dialect.name == "postgresql":
        installed = op.get_bind().execute(sa.text(
            "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
        for new, old in CHANGES:
            if installed.count(new) != 1:
                raise RuntimeError("kiln_settle changed since 0013: write this downgrade again")
            installed = installed.replace(new, old)
        op.execute("ALTER TABLE usage_daily DROP CONSTRAINT pk_usage_daily, "
                   "ADD CONSTRAINT pk_usage_daily PRIMARY KEY (org_id, day, model, api_key_id)")
        op.drop_column("usage_daily", "endpoint")
        op.execute(installed)
        return
    with _rebuild() as batch:
        batch.drop_column("endpoint")
        batch.create_primary_key("pk_usage_daily", KEY)


@contextlib.contextmanager
def _rebuild():
    """SQLite: rebuild the rollup with a new primary key. SQLAlchemy warns that the copy's
    reflected key differs from the one being made, which is the point of the rebuild."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Table '_alembic_tmp_usage_daily' specifies columns",
                                sa.exc.SAWarning)
        with op.batch_alter_table("usage_daily", recreate="always") as batch:
            yield batch
