"""A generation its worker's stop cut short (``interrupted``: a shutdown, or a reload that
outlasted the graceful timeout) is not counted among the errors of the daily rollup
(``usage_daily.errors``, docs/ACTIVITY.md "What a row counts"): the operator stopped it, the
customer did nothing wrong. Until now such a generation was settled as ``error``.

Postgres: ``kiln_settle`` (``gateway/ledger/postgres.py``) counts ``interrupted`` as it counts
``completed`` and ``client_cancelled``; the rows already rolled up stay as they were (the
usage events of before carry ``error``, so nothing to recount). SQLite rolls up in Python
(``gateway/ledger/sqlite.py``): nothing to change in the database. Downgrade puts back the
function without this change; events settled ``interrupted`` keep that status (a downgraded
Kiln reads it as any other ending it does not know: an error in the rollup of later days).

Revision ID: 0018
Revises: 0013
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0018"
down_revision = "0013"
branch_labels = None
depends_on = None

# The installed kiln_settle before this revision differed by this hunk (new, old).
NEW = "NOT IN ('completed', 'client_cancelled', 'interrupted')"
OLD = "NOT IN ('completed', 'client_cancelled')"


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    installed = op.get_bind().execute(sa.text(
        "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
    if installed.count(NEW) != 1:
        raise RuntimeError("kiln_settle changed since 0018: write this downgrade again")
    op.execute(installed.replace(NEW, OLD))
