"""Each usage event says which count it bills, per kind of token: ``prompt_counted_by`` and
``completion_counted_by``, one of ``backend`` (the backend's reported usage), ``tokenizer``
(Kiln's own exact count, by the model's local tokenizer or the backend's tokenize endpoint),
``bound`` (Kiln's upward bound) or ``progress`` (the progress the sweeper billed for a lost
worker); NULL while pending, when nothing was counted, and for events settled before this
revision (docs/METERING.md, "Which count applies").

Two nullable columns: a change of the catalog only, on Postgres and SQLite. Postgres: the
``kiln_settlement`` type gains ``prompt_by`` and ``completion_by`` (``kiln_settle``'s signature,
``(p_batch jsonb)``, is unchanged: a batch without them writes NULL), and ``kiln_settle``
(``gateway/ledger/postgres.py``) writes them. Downgrade puts back the function without this
change, then drops the attributes and the columns.

Revision ID: 0014
Revises: 0017
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE, SETTLEMENT_COUNTED_BY

revision = "0014"
down_revision = "0017"
branch_labels = None
depends_on = None

COLUMNS = ("prompt_counted_by", "completion_counted_by")
# The installed kiln_settle before this revision differed by this hunk (new, old).
CHANGES = (
    ("""                estimated = d.estimated, prompt_counted_by = d.prompt_by,
                completion_counted_by = d.completion_by, http_status = d.http_status,
                error = d.error,""",
     """                estimated = d.estimated, http_status = d.http_status, error = d.error,"""),
)


def upgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    for name in COLUMNS:
        op.add_column("usage_events", sa.Column(name, sa.String(16), nullable=True))
    if postgres:
        op.execute(SETTLEMENT_COUNTED_BY)
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        installed = op.get_bind().execute(sa.text(
            "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
        for new, old in CHANGES:
            if installed.count(new) != 1:
                raise RuntimeError("kiln_settle changed since 0014: write this downgrade again")
            installed = installed.replace(new, old)
        op.execute(installed)
        op.execute("ALTER TYPE kiln_settlement DROP ATTRIBUTE completion_by, "
                   "DROP ATTRIBUTE prompt_by")
        for name in COLUMNS:
            op.drop_column("usage_events", name)
    else:  # SQLite 3.35 and later drop a column in place
        for name in COLUMNS:
            op.execute(f"ALTER TABLE usage_events DROP COLUMN {name}")
