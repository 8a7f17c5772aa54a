"""Tables (SQLAlchemy Core). Alembic revisions build them; ``alembic check`` compares against this.

Money is kept in integer nano-dollars (``*_nanos``, 1 USD = 10**9) so that Postgres and SQLite
both add it exactly; ``credit_grants.amount_usd`` is NUMERIC so an operator can top up in plain
SQL, and its trigger converts. Invariant per org at a quiet moment:
``balance_nanos = Σ grants − Σ usage_events.cost_nanos``, ``held_nanos = 0``, ``in_flight = 0``.
"""
import re
import secrets
import time

import sqlalchemy as sa

from .endings import Status

metadata = sa.MetaData(naming_convention={
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})

TS = sa.DateTime(timezone=True)

orgs = sa.Table(
    "orgs", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("status", sa.String(16), nullable=False, server_default="active"),
    # NULL: the gateway's default (KILN_DEFAULT_IN_FLIGHT_LIMIT, 8).
    sa.Column("in_flight_limit", sa.Integer, nullable=True),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
    sa.CheckConstraint("status IN ('active', 'suspended')", name="status"),
)

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False, index=True),
    sa.Column("prefix", sa.String(16), nullable=False, unique=True),
    sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("name", sa.String(200), nullable=True),
    # Space-separated public model ids; NULL allows every model.
    sa.Column("allowed_models", sa.Text, nullable=True),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
    sa.Column("revoked_at", TS, nullable=True),
    # Written at most once a minute per key (by settlement), not on every request.
    sa.Column("last_used_at", TS, nullable=True),
    # Optional spend limit in USD (an operator may set it in SQL), reset at the start of each
    # UTC day, ISO week or month, or never (NULL); spent and held in the current period.
    sa.Column("limit_usd", sa.Numeric(20, 9, asdecimal=True), nullable=True),
    sa.Column("limit_reset", sa.String(8), nullable=True),
    sa.Column("period_start", TS, nullable=True),
    sa.Column("period_spent_nanos", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("held_nanos", sa.BigInteger, nullable=False, server_default="0"),
    # The key may read its org's other keys and org-wide activity (off for restricted keys:
    # created with a model allow-list or a spend limit; migration 0012).
    sa.Column("org_read", sa.Boolean, nullable=False, server_default=sa.true()),
    # Optional requests per UTC minute; the current minute and its count.
    sa.Column("rpm_limit", sa.Integer, nullable=True),
    sa.Column("rate_window", TS, nullable=True),
    sa.Column("rate_count", sa.Integer, nullable=False, server_default="0"),
    # Migration 0015 (docs/KEYS.md): the key may manage its org's keys (the keys API); when
    # it stops working; its own cap of requests in flight (NULL: only the org's); the secret it
    # had before its last rotation, accepted until ``previous_expires_at``.
    sa.Column("manage", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("expires_at", TS, nullable=True),
    sa.Column("in_flight_limit", sa.Integer, nullable=True),
    sa.Column("previous_key_hash", sa.String(64), nullable=True),
    sa.Column("previous_expires_at", TS, nullable=True),
    sa.CheckConstraint("limit_reset IN ('daily', 'weekly', 'monthly')", name="limit_reset"),
    sa.CheckConstraint("limit_usd >= 0", name="limit_not_negative"),
    # Admission compares the limit in BIGINT nano-dollars (migration 0004).
    sa.CheckConstraint("limit_usd <= 9223372036.854775807", name="limit_in_range"),
    sa.CheckConstraint("rpm_limit > 0", name="rpm_positive"),
    sa.CheckConstraint("in_flight_limit > 0", name="in_flight_limit_positive"),
    sa.Index("ix_api_keys_previous_key_hash", "previous_key_hash", unique=True),
)

# Every change to a key (created, changed, rotated, revoked), by a management key or by the
# operator's ``kiln key``: append-only (triggers refuse UPDATE and DELETE; migration 0015).
# ``changes`` is a JSON object of the fields set (never a secret or a hash).
key_changes = sa.Table(
    "key_changes", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False),
    sa.Column("api_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), nullable=False),
    sa.Column("actor", sa.String(16), nullable=False),  # "key" or "operator"
    sa.Column("actor_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), nullable=True),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("changes", sa.Text, nullable=False),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
    sa.CheckConstraint("actor IN ('key', 'operator')", name="actor"),
    sa.CheckConstraint("action IN ('create', 'update', 'rotate', 'revoke')", name="action"),
    sa.Index("ix_key_changes_key_created", "api_key_id", "created_at"),
)

credit_balances = sa.Table(
    "credit_balances", metadata,
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), primary_key=True),
    sa.Column("balance_nanos", sa.BigInteger, nullable=False, server_default="0"),
    # Sum of the holds of admitted, unsettled requests.
    sa.Column("held_nanos", sa.BigInteger, nullable=False, server_default="0"),
    # Count of admitted, unsettled requests (their lease rows are in in_flight).
    sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
    sa.CheckConstraint("balance_nanos >= 0", name="balance_not_negative"),
)

credit_grants = sa.Table(
    "credit_grants", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False, index=True),
    sa.Column("amount_usd", sa.Numeric(20, 9, asdecimal=True), nullable=False),
    sa.Column("note", sa.Text, nullable=True),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
)

usage_events = sa.Table(
    "usage_events", metadata,
    sa.Column("id", sa.String(40), primary_key=True),  # the generation id
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False),
    sa.Column("api_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("backend", sa.String(500), nullable=True),
    sa.Column("stream", sa.Boolean, nullable=False),
    # The API the client called: a codec's name (gateway.dialects), "chat" before there were
    # others (migration 0009).
    sa.Column("endpoint", sa.String(16), nullable=False, server_default="chat"),
    # pending until settled; then how it ended (gateway.flow.outcomes.Status).
    sa.Column("status", sa.String(24), nullable=False, server_default=Status.PENDING.value),
    sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cached_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cost_nanos", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("hold_nanos", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("estimated", sa.Boolean, nullable=False, server_default=sa.false()),
    # Which count each kind of token bills (gateway.billing.COUNTED_BY: backend, tokenizer,
    # bound, progress; migration 0014); NULL while pending, when nothing was counted, and on
    # events settled before 0014.
    sa.Column("prompt_counted_by", sa.String(16), nullable=True),
    sa.Column("completion_counted_by", sa.String(16), nullable=True),
    sa.Column("http_status", sa.Integer, nullable=True),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("first_token_at", TS, nullable=True),
    sa.Column("ended_at", TS, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    # The outcome's code (gateway.flow.outcomes), every backend tried (JSON array of URLs), and
    # whether the backend reported more than Kiln held for.
    sa.Column("error_code", sa.String(64), nullable=True),
    sa.Column("attempts", sa.Text, nullable=True),
    sa.Column("anomaly", sa.Boolean, nullable=False, server_default=sa.false()),
    # GET /v1/generations lists an org's events newest first by (started_at, id): each page
    # is one range scan of this index from its cursor (migration 0017).
    sa.Index("ix_usage_events_org_started_id", "org_id", "started_at", "id"),
)

in_flight = sa.Table(
    "in_flight", metadata,
    sa.Column("generation_id", sa.String(40), sa.ForeignKey("usage_events.id"), primary_key=True),
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False),
    sa.Column("hold_nanos", sa.BigInteger, nullable=False),
    # The part of the hold counted against the key's limit (0 when it has none).
    sa.Column("key_hold_nanos", sa.BigInteger, nullable=False, server_default="0"),
    # The key that holds the lease: a key's in-flight cap counts its lease rows (migration
    # 0015), so a lease released anywhere (settlement, the sweeper) is released for the key.
    sa.Column("api_key_id", sa.Integer, nullable=True),
    # A lease stops counting after this time unless renewed (worker killed: SIGKILL, OOM).
    sa.Column("expires_at", TS, nullable=False),
    sa.Index("ix_in_flight_org_expires", "org_id", "expires_at"),
    sa.Index("ix_in_flight_key", "api_key_id"),
)

# One row per org, UTC day (of the generation's start), model and key: what GET /v1/activity
# serves. Written by settlement in the same transaction as the usage events it sums.
usage_daily = sa.Table(
    "usage_daily", metadata,
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), primary_key=True),
    sa.Column("day", sa.Date, primary_key=True),
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("api_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), primary_key=True),
    # The API the requests were made to (usage_events.endpoint; migration 0013).
    sa.Column("endpoint", sa.String(16), primary_key=True, server_default="chat"),
    sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("errors", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cost_nanos", sa.BigInteger, nullable=False, server_default="0"),
)

maintenance = sa.Table(
    "maintenance", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("retry_after_s", sa.Integer, nullable=False, server_default="300"),
    sa.Column("message", sa.Text, nullable=True),
    sa.Column("updated_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
)

# Stored responses (POST /v1/responses with ``store``; docs/RESPONSES.md): the customer's data,
# per org, until ``expires_at`` (then swept). ``response`` and ``input_items`` are JSON text;
# ``generation_id`` names the usage event that billed it (no foreign key: a response outlives
# nothing it names, and an unmetered gateway writes no usage event).
stored_responses = sa.Table(
    "stored_responses", metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # resp_...
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False),
    sa.Column("generation_id", sa.String(40), nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("previous_response_id", sa.String(64), nullable=True),
    sa.Column("response", sa.Text, nullable=False),
    sa.Column("input_items", sa.Text, nullable=False),
    sa.Index("ix_stored_responses_org_created", "org_id", "created_at"),
    sa.Index("ix_stored_responses_expires", "expires_at"),
)
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{48}")


def new_response_id(now=None):
    """Return a fresh ``stored_responses.id``: ``resp_`` and 48 hex digits, as OpenAI's are,
    the first 8 the creation time in Unix seconds (as OpenAI's also read), the other 40 random.
    The time lets a reader tell a row not written yet from an unknown one
    (:func:`gateway.ledger.responses.written`)."""
    return f"resp_{int(now or time.time()) & 0xFFFFFFFF:08x}{secrets.token_hex(20)}"


def response_id_created_at(response_id):
    """The Unix second a :func:`new_response_id` id was made in, or None for another shape."""
    if not isinstance(response_id, str) or not _RESPONSE_ID.fullmatch(response_id):
        return None
    return int(response_id[5:13], 16)

# Webhooks (docs/WEBHOOKS.md): per org, a URL, its Standard Webhooks secret (``whsec_`` +
# base64; Postgres generates one when an INSERT gives none) and the events it wants
# (comma-separated: balance.low, key.limit_reached, key.expiring, credits.refused). The outbox
# holds each event, written in the transaction of what caused it; ``dedup_key`` makes one
# crossing one event. Each delivery attempt is logged in ``webhook_deliveries``.
webhooks = sa.Table(
    "webhooks", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False, index=True),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("secret", sa.String(120), nullable=False),
    sa.Column("events", sa.Text, nullable=False),
    # balance.low: the org's balance went below this (exact USD); NULL: never.
    sa.Column("balance_below_usd", sa.Numeric(20, 9, asdecimal=True), nullable=True),
    # Deliver even where the URL's host resolves to a private or loopback address.
    sa.Column("allow_private", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
    sa.CheckConstraint("balance_below_usd >= 0", name="threshold_not_negative"),
)

webhook_outbox = sa.Table(
    "webhook_outbox", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
    sa.Column("webhook_id", sa.Integer, sa.ForeignKey("webhooks.id", ondelete="CASCADE"),
              nullable=False),
    sa.Column("event_type", sa.String(40), nullable=False),
    sa.Column("dedup_key", sa.String(200), nullable=True),
    sa.Column("payload", sa.Text, nullable=False),  # the JSON body, signed and sent as is
    # pending until delivered (a 2xx) or failed (its attempts used up).
    sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    # When it may be tried next: after a failure, or after a claim that never reported.
    sa.Column("next_attempt_at", TS, nullable=False,
              server_default=sa.func.current_timestamp()),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.current_timestamp()),
    sa.Column("finished_at", TS, nullable=True),
    sa.CheckConstraint("status IN ('pending', 'delivered', 'failed')", name="status"),
    sa.UniqueConstraint("webhook_id", "dedup_key", name="uq_webhook_outbox_dedup"),
    sa.Index("ix_webhook_outbox_due", "status", "next_attempt_at"),
)

webhook_deliveries = sa.Table(
    "webhook_deliveries", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
    sa.Column("outbox_id", sa.BigInteger,
              sa.ForeignKey("webhook_outbox.id", ondelete="CASCADE"), nullable=False,
              index=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("at", TS, nullable=False, server_default=sa.func.current_timestamp()),
    sa.Column("status_code", sa.Integer, nullable=True),  # NULL: no HTTP answer
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("duration_ms", sa.Integer, nullable=True),
    sa.Column("deliverer", sa.String(200), nullable=True),  # host:pid of the worker
)
