"""Settings: one object, built from ``KILN_*`` environment variables or a mapping.

No other module reads ``os.environ``; tests pass a mapping to ``create_app``.
"""
import os
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_SQLITE = "sqlite:///kiln.db"
# Settings that an OpenTelemetry variable gives when their KILN_* one is unset (the
# OpenTelemetry specification, "Environment Variable Specification" and OTLP exporter).
STANDARD = {"otel_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
            "otel_service_name": "OTEL_SERVICE_NAME"}


@dataclass(frozen=True)
class Config:
    """Gateway settings; every field maps to ``KILN_<FIELD_NAME_UPPER>``."""

    database_url: str = DEFAULT_SQLITE
    models: str = str(Path(__file__).with_name("demo_models.toml"))
    max_body_bytes: int = 16 * 1024 * 1024
    default_in_flight_limit: int = 8
    lease_ttl_s: float = 60.0
    keepalive_s: float = 10.0
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 300.0
    upstream_pool_size: int = 256
    key_cache_ttl_s: float = 10.0
    # Each worker writes a key's last_used_at at most once per this many seconds
    # (gateway/api/auth.py).
    key_last_used_interval_s: float = 60.0
    maintenance_poll_s: float = 2.0
    sweep_interval_s: float = 15.0
    # The ledger's connections per worker: kept open, and opened beyond it under a burst
    # (then closed). Reads (keys, the maintenance flag, account views) use 2 more.
    db_pool_size: int = 4
    db_max_overflow: int = 12
    # Longest wait for a pooled database connection before a request is told 503 (and, one
    # second more, for its admission statement: a stalled database is a 503, not a hang).
    db_pool_timeout_s: float = 5.0
    # Largest non-stream reply and largest single stream event read from a backend; a
    # non-stream reply is also bounded by its request's own limits (docs/RELIABILITY.md,
    # "Big answers": parsing and writing a reply holds the worker's event loop).
    max_reply_bytes: int = 16 * 1024 * 1024
    max_event_bytes: int = 4 * 1024 * 1024
    # On graceful shutdown, the longest wait for queued settlements to commit.
    settle_drain_s: float = 30.0
    # True: a generation's last bytes wait for its settlement to commit (up to settle_wait_s;
    # then they go out anyway and the settlement keeps being retried), so that a worker killed
    # just after an answer cannot leave it to the sweeper. False: they leave at once and the
    # settlement commits a few milliseconds later (docs/METERING.md).
    settle_before_answer: bool = False
    settle_wait_s: float = 5.0
    # True: the request of an org this worker admitted last (within a minute, no refusal
    # since) goes to its backend while its admission runs; nothing is relayed before it is
    # admitted, and a refusal stops the backend at once. Off by default: a request refused
    # at the in-flight limit has then reached a backend for a moment (docs/METERING.md,
    # "Early send").
    early_send: bool = False
    # False: no lease, no hold, no usage event, no debit. For benchmarks only (bench/metering.py).
    metering: bool = True
    trusted_proxies: str = "127.0.0.1,::1"
    # Browser origins allowed to call the API (comma-separated, or "*"); empty: CORS off.
    cors_origins: str = ""
    log_requests: bool = True
    # A fleet of backends (docs/ROUTING.md): retries before the first byte, circuit breaker,
    # active probe, and the wait for a slot on a backend at its catalog max_in_flight.
    upstream_retries: int = 2
    upstream_retry_deadline_s: float = 60.0
    upstream_retry_backoff_s: float = 0.05
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    probe_interval_s: float = 5.0
    probe_path: str = "/models"
    probe_timeout_s: float = 2.0
    backend_wait_s: float = 5.0
    slot_dir: str = ""
    # Stored responses (POST /v1/responses, docs/RESPONSES.md): whether ``store`` defaults to
    # true, as OpenAI's does, and how long a stored response is kept (then swept).
    responses_store_default: bool = True
    responses_retention_days: int = 30
    # The items of stored responses each worker keeps parsed, in MiB of their rows' JSON, so
    # that a continued conversation reads its chain's ids only (0: none kept).
    responses_cache_mb: int = 8
    # Bounded work before admission (gateway/api/intake.py, gateway/api/auth.py): the longest a
    # request body may take to arrive (408); the bytes of large bodies one worker reads and
    # parses at once, and the longest wait for a share of them (then 503 with Retry-After); how
    # long an unknown key is remembered as unknown (no database query for it meanwhile).
    body_timeout_s: float = 30.0
    parse_budget_bytes: int = 32 * 1024 * 1024
    parse_wait_s: float = 2.0
    unknown_key_cache_ttl_s: float = 5.0
    # The most rows one CSV export of GET /v1/generations may hold: a larger export is a 400
    # that asks for a narrower time range (docs/ACTIVITY.md, "Every request").
    export_max_rows: int = 1_000_000
    # Webhooks (docs/WEBHOOKS.md; Postgres only): how often each worker looks for due events and
    # how many it takes at once; a receiver's time to answer; the first wait before a failed
    # delivery is tried again (doubling up to the longest) and the attempts before an event is
    # marked failed; how soon before a key's expiry ``key.expiring`` is sent, and how often
    # each worker looks for such keys; whether ``kiln webhook add`` (and delivery) take URLs
    # whose host is a private or loopback address.
    webhook_poll_s: float = 2.0
    webhook_batch: int = 20
    webhook_timeout_s: float = 10.0
    webhook_backoff_s: float = 5.0
    webhook_backoff_max_s: float = 3600.0
    webhook_max_attempts: int = 10
    webhook_key_expiring_s: float = 7 * 24 * 3600.0
    webhook_expiring_scan_s: float = 60.0
    webhook_allow_private: bool = False
    # Image URLs' host names (gateway/contract/image_hosts.py): the name servers asked
    # ("ip[:port],..."; empty: /etc/resolv.conf), the longest one request waits for a name,
    # the lookups at once per worker and per org, and how long answers are cached.
    image_nameservers: str = ""
    image_resolve_timeout_s: float = 2.0
    image_lookups_per_worker: int = 32
    image_lookups_per_org: int = 4
    image_cache_size: int = 4096
    image_cache_ttl_s: float = 300.0
    image_negative_ttl_s: float = 30.0
    # Traces (docs/TRACES.md): the OTLP/HTTP endpoint spans are exported to (base URL; spans go
    # to {endpoint}/v1/traces); empty: tracing off. Unset, the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT is read instead.
    otel_endpoint: str = ""
    otel_service_name: str = "kiln-gateway"

    @classmethod
    def from_mapping(cls, values=None):
        """Build from ``values`` (field name -> value) over the ``KILN_*`` environment.

        :param values: mapping of field names to values; wins over the environment.
        :raises ValueError: a value does not parse as the field's type.
        """
        values = dict(values or {})
        kwargs = {}
        for f in fields(cls):
            raw = values.get(f.name, os.environ.get("KILN_" + f.name.upper(),
                                                    os.environ.get(STANDARD.get(f.name, ""))))
            if raw is None:
                continue
            kwargs[f.name] = _coerce(f.name, f.type, raw)
        return cls(**kwargs)

    @property
    def trusted_proxy_set(self):
        """Addresses whose ``X-Forwarded-For`` is believed."""
        return frozenset(p.strip() for p in self.trusted_proxies.split(",") if p.strip())


def environment():
    """The process environment, for the catalog's backend keys (``api_key_env``): the one read
    of it beside the ``KILN_*`` settings."""
    return os.environ


def _coerce(name, type_, raw):
    if not isinstance(raw, str) or type_ is str:
        return raw
    try:
        if type_ is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return {"int": int, "float": float}[type_.__name__](raw)
    except (KeyError, ValueError) as err:
        raise ValueError(f"KILN_{name.upper()}: cannot read {raw!r} as {type_.__name__}") from err
