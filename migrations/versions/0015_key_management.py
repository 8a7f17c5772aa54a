"""Keys managed through the API (docs/KEYS.md): a key may carry the permission to manage its
org's keys (``manage``), stop working at ``expires_at``, have its own cap of requests in flight,
and keep its previous secret for a grace period after a rotation; every change to a key is
recorded in ``key_changes``, which the database keeps append-only (triggers refuse UPDATE and
DELETE, on both dialects).

A key's in-flight cap counts its lease rows: ``in_flight`` gains the key of each lease
(backfilled from the leases' usage events), and ``kiln_admit`` counts them under the key's row
lock. Nothing else changes in the ledger: the one statement that deletes a lease (settlement,
which the sweeper also goes through) releases it for the key too.

Postgres: the columns' defaults are constants (a change of the catalog only), after a moment's
lock (``migrations/env.py``: a revision waits at most 500 ms for a lock, then
is tried again). Downgrade puts back the installed ``kiln_admit`` without this change.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import ADMIT

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
ADMIT_SIGNATURE = ("kiln_admit(text, integer, integer, text, boolean, bigint, integer, "
                   "double precision, boolean, text)")
# The installed kiln_admit before this revision differed by these hunks (new, old).
ADMIT_CHANGES = (
    ("""  v_leases integer;
""", ""),
    ("""    -- The key's in-flight cap counts its lease rows, read under the key's row lock (a new
    -- snapshot per statement: every admission that held the lock before has committed its
    -- lease); a lease deleted anywhere (settlement, the sweeper) no longer counts.
    SELECT count(*) INTO v_leases FROM in_flight f
     WHERE v_key.in_flight_limit IS NOT NULL AND f.api_key_id = p_key;
    IF (v_key.in_flight_limit IS NOT NULL AND v_leases >= v_key.in_flight_limit)
       OR (v_key.rpm_limit IS NOT NULL AND v_rate >= v_key.rpm_limit)""",
     """    IF (v_key.rpm_limit IS NOT NULL AND v_rate >= v_key.rpm_limit)"""),
    ("""        CASE WHEN v_key.in_flight_limit IS NOT NULL AND v_leases >= v_key.in_flight_limit
             THEN 'key_in_flight'
             WHEN v_key.rpm_limit IS NOT NULL AND v_rate >= v_key.rpm_limit THEN 'rate'
             ELSE 'key_limit' END,
        NULL::bigint, v_leases,
        EXISTS (SELECT 1 FROM in_flight f WHERE f.api_key_id = p_key AND f.expires_at < v_now),
        v_limit - v_spent - v_key.held_nanos, v_period;""",
     """        CASE WHEN v_key.rpm_limit IS NOT NULL AND v_rate >= v_key.rpm_limit THEN 'rate'
             ELSE 'key_limit' END,
        NULL::bigint, NULL::integer, false, v_limit - v_spent - v_key.held_nanos, v_period;"""),
    ("""  INSERT INTO in_flight (generation_id, org_id, hold_nanos, key_hold_nanos, expires_at,
                         api_key_id)
  VALUES (p_gid, p_org, p_hold, CASE WHEN p_key_checks THEN p_hold ELSE 0 END,
          v_now + p_ttl_s * interval '1 second', p_key);""",
     """  INSERT INTO in_flight (generation_id, org_id, hold_nanos, key_hold_nanos, expires_at)
  VALUES (p_gid, p_org, p_hold, CASE WHEN p_key_checks THEN p_hold ELSE 0 END,
          v_now + p_ttl_s * interval '1 second');"""),
)
APPEND_ONLY_PG = (
    """CREATE FUNCTION kiln_key_changes_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'key_changes is append-only';
END $$""",
    "CREATE TRIGGER key_changes_append_only BEFORE UPDATE OR DELETE ON key_changes "
    "FOR EACH ROW EXECUTE FUNCTION kiln_key_changes_append_only()",
)
APPEND_ONLY_SQLITE = tuple(
    f"CREATE TRIGGER key_changes_no_{verb.lower()} BEFORE {verb} ON key_changes "
    f"BEGIN SELECT RAISE(ABORT, 'key_changes is append-only'); END"
    for verb in ("UPDATE", "DELETE"))


def upgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    # Plain ADD COLUMNs on both (SQLite's batch mode would rebuild tables others refer to).
    op.add_column("api_keys", sa.Column("manage", sa.Boolean, nullable=False,
                                        server_default=sa.false()))
    op.add_column("api_keys", sa.Column("expires_at", TS, nullable=True))
    if postgres:
        op.add_column("api_keys", sa.Column("in_flight_limit", sa.Integer, nullable=True))
        op.create_check_constraint(op.f("ck_api_keys_in_flight_limit_positive"), "api_keys",
                                   "in_flight_limit > 0")
    else:  # SQLite adds a CHECK only with its column
        op.execute("ALTER TABLE api_keys ADD COLUMN in_flight_limit INTEGER CONSTRAINT "
                   "ck_api_keys_in_flight_limit_positive CHECK (in_flight_limit > 0)")
    op.add_column("api_keys", sa.Column("previous_key_hash", sa.String(64), nullable=True))
    op.add_column("api_keys", sa.Column("previous_expires_at", TS, nullable=True))
    op.create_index("ix_api_keys_previous_key_hash", "api_keys", ["previous_key_hash"],
                    unique=True)
    op.add_column("in_flight", sa.Column("api_key_id", sa.Integer, nullable=True))
    op.execute("UPDATE in_flight SET api_key_id = (SELECT e.api_key_id FROM usage_events e "
               "WHERE e.id = in_flight.generation_id)")
    op.create_index("ix_in_flight_key", "in_flight", ["api_key_id"])
    _create_key_changes()
    for statement in APPEND_ONLY_PG if postgres else APPEND_ONLY_SQLITE:
        op.execute(statement)
    if postgres:
        op.execute(ADMIT)


def _create_key_changes():
    op.create_table(
        "key_changes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False),
        sa.Column("api_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("actor", sa.String(16), nullable=False),
        sa.Column("actor_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), nullable=True),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("changes", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False,
                  server_default=sa.func.current_timestamp()),
        sa.CheckConstraint("actor IN ('key', 'operator')", name=op.f("ck_key_changes_actor")),
        sa.CheckConstraint("action IN ('create', 'update', 'rotate', 'revoke')",
                           name=op.f("ck_key_changes_action")))
    op.create_index("ix_key_changes_key_created", "key_changes", ["api_key_id", "created_at"])


def downgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.execute(_installed_admit())
        op.execute("DROP TABLE key_changes")
        op.execute("DROP FUNCTION kiln_key_changes_append_only()")
    else:
        op.execute("DROP TABLE key_changes")  # its triggers go with it
    op.drop_index("ix_in_flight_key", "in_flight")
    op.drop_index("ix_api_keys_previous_key_hash", "api_keys")
    if postgres:
        op.drop_constraint("ck_api_keys_in_flight_limit_positive", "api_keys")
    columns = (("in_flight", "api_key_id"), ("api_keys", "previous_expires_at"),
               ("api_keys", "previous_key_hash"), ("api_keys", "in_flight_limit"),
               ("api_keys", "expires_at"), ("api_keys", "manage"))
    for table, column in columns:
        if postgres:
            op.drop_column(table, column)
        else:  # SQLite 3.35 and later drop a column in place
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")


def _installed_admit():
    """The installed ``kiln_admit`` with this revision's hunks undone."""
    text = op.get_bind().execute(sa.text(
        f"SELECT pg_get_functiondef('{ADMIT_SIGNATURE}'::regprocedure)")).scalar_one()
    for new, old in ADMIT_CHANGES:
        if text.count(new) != 1:
            raise RuntimeError("kiln_admit changed since 0015: write this downgrade again")
        text = text.replace(new, old)
    return text
