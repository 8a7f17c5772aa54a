"""The ledger: every statement that moves money or in-flight leases.

Admission (hold + lease + pending usage event), renewal of live leases, settlement (exactly
once per generation), the sweeper, credit grants and reconciliation's reads all live here; the
dialects' statements are in :mod:`.postgres` and :mod:`.sqlite`; the webhook outbox that
settlements, grants and refusals write to is in :mod:`.outbox`. The request flow
(:mod:`gateway.flow.generation`) calls it; nothing else writes money.

May import only the shared modules at the top of ``gateway`` (tables, money math, statuses):
never the flow, a view or a codec.

Invariants, per org (``kiln credits reconcile`` checks them):

1. ``balance_nanos = Σ credit_grants − Σ usage_events.cost_nanos``: a grant's trigger and a
   settlement move the balance in the transaction that writes their row.
2. ``held_nanos = Σ in_flight.hold_nanos`` and ``in_flight = count(in_flight)``: admission and
   settlement move them with the lease row; ``0 ≤ held_nanos ≤ balance_nanos`` (CHECKs), so a
   balance never goes below zero.
3. A usage event leaves ``pending`` once, under its row lock, and its lease goes with it; the
   sweeper settles only leases still expired once the event is locked.
4. ``api_keys.held_nanos = Σ in_flight.key_hold_nanos`` of the key's leases (a key's own
   in-flight cap counts its lease rows, ``in_flight.api_key_id``, under its row lock: a lease
   deleted by settlement, or by the sweeper through it, is the key's slot released), and
   ``usage_daily`` sums the settled events (written by the same settlement).

Row locks are always taken in this order: usage events (by id), leases, balances (by org id),
keys, daily rows. Admission locks a balance, then a key; renewal locks events (skipping those
being settled), then leases; settlement locks events, then balances in org order.

Durability and the client's clock: admission commits without waiting for its WAL flush (an
admission lost in a database crash is written again by its settlement). Settlements are
committed in batches (one transaction for those queued at that moment), by a writer greenlet
after the answer's last bytes have left (docs/METERING.md, "When the usage event is final"); on
Postgres the batch's transaction does not wait for its WAL flush, so the rows it locked are
free at once, and the writer then waits for the flush in a transaction that locks nothing (the
two in one round trip) before it counts the batch committed; a settlement that fails, or whose
flush does, is retried until it is durable. A generation's slot and hold stay taken until then,
so a refusal for the in-flight limit or credits first waits for this worker's outstanding
settlements of the org (or, with none, a moment for another worker's) and asks once more.
"""
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import gevent
import psycopg
import sqlalchemy as sa
from gevent.event import Event

from ..billing import (BY_PROGRESS, MAX_TOKENS_COUNT, Usage, cost_nanos, format_dollars,
                       to_nanos)
from ..db import is_postgres
from ..errors import DatabaseBusy, DatabaseUnavailable, InsufficientCredits, RateLimited
from ..endings import LEASE_EXPIRED, Status
from . import outbox
from .early import RecentAdmissions
from .postgres import PostgresStore
from .sqlite import SqliteStore
from .worker import SETTLE_DEFER_S, Admitter, AdmissionTurn, Renewer, SettlementWriter

log = logging.getLogger(__name__)

ADMIT_ATTEMPTS = 4
# Refusals that a settlement about to commit may lift (its slot and hold come back), and how
# long to wait for another worker's before asking again.
SETTLING_REASONS = frozenset({"in_flight", "key_in_flight", "credits", "key_limit"})
# Refusals for a count of leases, which expired leases (a dead worker's) may fill.
LEASE_REASONS = frozenset({"in_flight", "key_in_flight"})
RECHECK_S = 0.02
# Refusals (402) that webhooks announce: the org's credits, the key's spend limit.
WEBHOOK_REASONS = frozenset({"credits", "key_limit"})
ABANDONED_ERROR = "lease expired: the worker serving this request was lost"


class KeyLimitExceeded(InsufficientCredits):
    code = "key_limit_exceeded"


@dataclass(frozen=True)
class AdmissionRequest:
    """What admission needs: who, what, and the hold (nano-dollars)."""

    gid: str
    org_id: int
    key_id: int
    model: str
    stream: bool
    hold_nanos: int
    in_flight_limit: int
    lease_ttl_s: float
    key_checks: bool  # the key has a spend limit, a request rate or an in-flight cap
    limit_usd: object = None   # the key's spend limit (Decimal USD), for messages
    key_in_flight_limit: int = None  # the key's own in-flight cap, for messages
    limit_reset: str = None    # "daily", "weekly", "monthly" or None
    endpoint: str = "chat"     # the dialect the client spoke (gateway.dialects: a codec's name)


@dataclass
class Settlement:
    """How a generation ended: what settlement writes (and enough to write the usage event
    itself when its admission was lost)."""

    gid: str
    org_id: int
    key_id: int
    model: str
    stream: bool
    status: str
    usage: Usage
    cost_nanos: int
    http_status: int = None
    error: str = None
    error_code: str = None
    backend: str = None
    attempts: list = None
    anomaly: bool = False
    started_at: datetime = None
    first_token_at: datetime = None
    expired_before: datetime = None  # the sweeper: settle only if the lease expired before
    committed: Event = field(default_factory=Event, repr=False, compare=False)
    debited: int = None  # nano-dollars debited, once committed (None: settled before)

    def __post_init__(self):
        self.error = storable(self.error)

    def salvaged(self):
        """Return this settlement with every value within its column (counts and statuses
        within 32 bits, the cost within 64, texts within their lengths: what can be billed of
        it), or None when nothing here is out of range (the database refused it for another
        reason)."""
        u = self.usage
        usage = Usage(prompt=_clamp(u.prompt, MAX_TOKENS_COUNT),
                      cached=_clamp(u.cached, MAX_TOKENS_COUNT),
                      completion=_clamp(u.completion, MAX_TOKENS_COUNT), estimated=u.estimated,
                      prompt_by=u.prompt_by, completion_by=u.completion_by)
        values = {"usage": usage, "cost_nanos": _clamp(self.cost_nanos, MAX_BIGINT),
                  "http_status": None if self.http_status is None
                  else _clamp(self.http_status, MAX_TOKENS_COUNT),
                  "model": self.model[:MODEL_CHARS], "error_code": (self.error_code or None)
                  and self.error_code[:CODE_CHARS],
                  "backend": (self.backend or None) and self.backend[:BACKEND_CHARS]}
        if all(getattr(self, name) == value for name, value in values.items()):
            return None
        return dataclasses.replace(self, **values, committed=Event(), debited=None)

    def as_record(self):
        """Return the JSON record of ``kiln_settle`` (the ``kiln_settlement`` type)."""
        u = self.usage
        return {"gid": self.gid, "org": self.org_id, "key": self.key_id, "model": self.model,
                "stream": self.stream, "status": self.status, "prompt": u.prompt,
                "cached": u.cached, "completion": u.completion, "cost": self.cost_nanos,
                "http_status": self.http_status, "error": self.error,
                "error_code": self.error_code, "backend": self.backend,
                "attempts": json.dumps(self.attempts) if self.attempts else None,
                "anomaly": self.anomaly, "estimated": u.estimated,
                "prompt_by": u.prompt_by, "completion_by": u.completion_by,
                "started_at": _iso(self.started_at), "first_token_at": _iso(self.first_token_at),
                "expired_before": _iso(self.expired_before)}


MAX_ERROR_CHARS = 2000


MAX_BIGINT = 2 ** 63 - 1
# usage_events' text column lengths (gateway/models.py).
MODEL_CHARS, CODE_CHARS, BACKEND_CHARS = 200, 64, 500


def _clamp(value, top):
    return max(0, min(int(value), top))


def storable(text):
    """Return ``text`` as Postgres can store it: no NUL, no lone surrogate (a backend's error
    message may carry either), at most :data:`MAX_ERROR_CHARS` characters."""
    if text is None:
        return None
    text = text[:MAX_ERROR_CHARS].replace("\x00", "\ufffd")
    return text.encode("utf-8", "replace").decode("utf-8")


def _iso(ts):
    return ts.isoformat() if ts is not None else None


@dataclass
class Lease:
    """A live generation's in-flight lease, renewed by its worker's renewer.

    :param progress: ``() -> Usage | None``, the usage so far (kept on the pending event, so
        that the sweeper bills it if this worker dies).
    """

    gid: str
    progress: object
    lost: Event = field(default_factory=Event)  # the sweeper settled it: stop relaying


class Ledger:
    """Admission, renewal, settlement and sweeping for one worker process.

    Admissions and settlements of concurrent requests are grouped into few statements
    (:mod:`.worker`); settlements are retried on any database error until they commit, and
    their leases stay renewed meanwhile. :meth:`drain` waits for them (graceful shutdown).
    """

    def __init__(self, engine, config, catalog, metrics=None, background=None):
        self.store = PostgresStore(engine) if is_postgres(engine) else SqliteStore(engine)
        self.config = config
        self.catalog = catalog
        self._turns = []  # the writers that go after this worker's admissions
        self._renewer = Renewer(self.store, config.lease_ttl_s, background=background)
        self._writer = SettlementWriter(self.store, metrics, on_committed=self._renewer.forget,
                                        background=background, turn=self.admission_turn())
        self._admitter = Admitter(self.store, on_orphan=self._settle_orphan,
                                  background=background, on_answered=self._answered)
        self.recent = RecentAdmissions()

    # -- admission ---------------------------------------------------------------------------

    def admit(self, request):
        """Admit one request; return ``(gid, started_at)``. What it raises is :meth:`_admit`'s;
        either way the org's answer is remembered (:meth:`likely_admitted`)."""
        try:
            admitted = self._admit(request)
        except BaseException:
            self.recent.refused(request.org_id)
            raise
        self.recent.admitted(request.org_id)
        return admitted

    def admission_turn(self):
        """Return an :class:`~.worker.AdmissionTurn` for a background writer of this worker
        (settlements, stored responses): its writes, off every client's clock, go after this
        worker's next admissions (at most :data:`~.worker.SETTLE_DEFER_S` later)."""
        turn = AdmissionTurn(SETTLE_DEFER_S)
        self._turns.append(turn)
        return turn

    def _answered(self):
        for turn in self._turns:
            turn.answered()

    def likely_admitted(self, org_id):
        """Whether this worker admitted ``org_id``'s last request, within a minute: its next
        may go to the backend while it is admitted (:mod:`.early`)."""
        return self.recent.likely(org_id)

    def _admit(self, request):
        """Admit one request; return ``(gid, started_at)``.

        A rejection that saw expired leases of the org (a dead worker's) reclaims them and tries
        again, so their slots and holds come back without waiting for a sweep.

        :param request: :class:`AdmissionRequest`.
        :raises RateLimited: 429, the org is at its in-flight limit, or the key at its rate;
            429 ``key_in_flight_limit``, the key is at its own in-flight cap.
        :raises InsufficientCredits: 402, the org's available credits do not cover the hold.
        :raises KeyLimitExceeded: 402, the key's spend limit does not cover the hold.
        :raises ServiceUnavailable: 503, the database is unreachable or too busy.
        """
        reclaimed = rechecked = False
        for _ in range(ADMIT_ATTEMPTS):
            row = self._admit_once(request)
            if row is None:  # no balance row: the org cannot pay
                raise insufficient_credits(0, request.hold_nanos)
            gid, started_at, reason, available, count, expired, remaining, period = row
            if gid is not None:
                return gid, started_at
            if reason in LEASE_REASONS and expired and not reclaimed:
                reclaimed = True
                self.sweep(org_id=request.org_id)
                continue
            if reason in SETTLING_REASONS and not rechecked:
                rechecked = True  # the org's last answers may not be settled yet
                if not self._writer.wait_for(self.config.settle_wait_s, org_id=request.org_id):
                    gevent.sleep(RECHECK_S)
                continue
            if reason != "retry":
                if reason in WEBHOOK_REASONS:
                    self._record_refusal(reason, request)
                raise _rejection(reason, request, available, remaining, period, count)
        raise RateLimited("Too many concurrent admissions for this organization. Retry with "
                          "backoff.")

    def _admit_once(self, request):
        try:
            return self._admitter.admit(request, timeout_s=self.config.db_pool_timeout_s + 1)
        except (sa.exc.TimeoutError, gevent.Timeout) as err:
            raise DatabaseBusy() from err
        except (sa.exc.DBAPIError, psycopg.Error, OSError) as err:
            log.error("admission failed: database unavailable: %s", err)
            raise DatabaseUnavailable() from err

    def _record_refusal(self, reason, request):
        """Write the webhook events of a 402 (``credits.refused``, ``key.limit_reached``) in
        one short transaction (Postgres; :mod:`.outbox`). A failure is logged, never the
        client's: the refusal is told all the same."""
        if not isinstance(self.store, PostgresStore):
            return
        try:
            with self.store.engine.begin() as conn:
                outbox.record_refusal(conn, reason, request.org_id, request.key_id,
                                      request.hold_nanos)
        except (sa.exc.SQLAlchemyError, psycopg.Error, OSError):
            log.exception("webhook event of a refusal (%s) not written", reason)

    def _settle_orphan(self, request, row):
        """Settle at once an admission that came back after its request gave up waiting (the
        client was told 503 ``database_busy``): nothing billed, its slot and hold released."""
        self.settle(Settlement(
            gid=row[0], org_id=request.org_id, key_id=request.key_id, model=request.model,
            stream=request.stream, status=Status.ERROR.value, usage=Usage(), cost_nanos=0,
            http_status=503, error="the database answered after the request gave up waiting",
            error_code="database_busy", started_at=row[1]))

    # -- live leases and settlement ----------------------------------------------------------

    def track(self, gid, progress):
        """Start renewing the lease of ``gid`` until its settlement commits; return the
        :class:`Lease` (its ``lost`` event is set if the sweeper settles it first)."""
        lease = Lease(gid, progress)
        self._renewer.track(lease)
        return lease

    def settle(self, settlement, wait_s=0):
        """Queue ``settlement`` for the writer, which commits it with the others queued at that
        moment (one transaction), retrying until it commits; wait up to ``wait_s`` for that.
        One that nobody waits for (``wait_s`` 0) lets this worker's next admission reach the
        database first, for at most :data:`~.worker.SETTLE_DEFER_S`. Never raises.

        :returns: whether it committed within ``wait_s``.
        """
        self._writer.put(settlement, urgent=bool(wait_s))
        return settlement.committed.wait(wait_s) if wait_s else False

    def drain(self, timeout_s):
        """Wait up to ``timeout_s`` for every queued settlement to commit; return whether all
        did (graceful shutdown)."""
        return self._writer.wait_idle(timeout_s)

    def wait_settled(self, timeout_s, gid=None, org_id=None):
        """Wait up to ``timeout_s`` for this worker's outstanding settlements of generation
        ``gid`` or org ``org_id`` to commit; return whether there were any."""
        return self._writer.wait_for(timeout_s, gid=gid, org_id=org_id)

    def renew_now(self):
        """Renew this worker's live leases now (they are renewed every third of the TTL, at
        most 5 s apart)."""
        self._renewer.renew_now()

    # -- sweeper -----------------------------------------------------------------------------

    def sweep(self, org_id=None, batch=200):
        """Settle the generations whose lease expired (their worker died) as ``abandoned``,
        billing their recorded progress; return how many were settled.

        :param org_id: only this org's (admission's reclaim), or every org.
        """
        rows = self.store.expired(org_id, batch)
        settlements = [self._abandoned(row) for row in rows]
        if not settlements:
            return 0
        closed = len(self.store.settle_batch(settlements))
        if closed:
            log.warning("sweeper closed %d abandoned generation(s)", closed)
        return closed

    def _abandoned(self, row):
        usage = Usage(prompt=row["prompt_tokens"], cached=row["cached_tokens"],
                      completion=row["completion_tokens"], estimated=True,
                      prompt_by=BY_PROGRESS, completion_by=BY_PROGRESS)
        entry = self.catalog.get(row["model"])
        cost = cost_nanos(usage, entry.pricing) if entry else 0
        return Settlement(gid=row["gid"], org_id=row["org"], key_id=row["key"],
                          model=row["model"], stream=row["stream"], status=Status.ABANDONED.value,
                          usage=usage, cost_nanos=cost, error=ABANDONED_ERROR,
                          error_code=LEASE_EXPIRED, started_at=row["started_at"],
                          expired_before=row["cutoff"])


class NullLedger:
    """No lease, no hold, no usage event, no debit: the benchmarks' unmetered baseline
    (``KILN_METERING=false``), chosen once in ``create_app``."""

    def admit(self, request):
        return request.gid, None

    def likely_admitted(self, org_id):
        return False  # admission is instant: nothing to overlap

    def admission_turn(self):
        return AdmissionTurn()  # no admissions to go after: writers write at once

    def track(self, gid, progress):
        return Lease(gid, progress)

    def settle(self, settlement, wait_s=0):
        settlement.debited = settlement.cost_nanos
        return True

    def drain(self, timeout_s):
        return True

    def wait_settled(self, timeout_s, gid=None, org_id=None):
        return False

    def sweep(self, org_id=None, batch=200):
        return 0


def _rejection(reason, request, available, remaining, period, count=None):
    if reason == "in_flight":
        return RateLimited(f"Too many requests in flight: this organization's limit is "
                           f"{request.in_flight_limit} at once. Retry with backoff.")
    if reason == "key_in_flight":
        return RateLimited(f"Too many requests in flight: this API key's limit is "
                           f"{request.key_in_flight_limit or count} at once. Retry with "
                           f"backoff.", code="key_in_flight_limit")
    if reason == "rate":
        return RateLimited("This API key is at its limit of requests per minute. Retry with "
                           "backoff.")
    if reason == "key_limit":
        return KeyLimitExceeded(
            f"This API key's spend limit of {format_dollars(to_nanos(request.limit_usd))}"
            f"{_resets(request.limit_reset, period)} does not cover this request: "
            f"{format_dollars(max(remaining, 0))} left, but the request needs a hold of "
            f"{format_dollars(request.hold_nanos)}. Lower max_tokens, or raise the key's limit.")
    return insufficient_credits(available, request.hold_nanos)


def _resets(reset, period):
    if reset is None or period is None:
        return " (it does not reset)"
    return f" per {PERIOD_NAMES[reset]} (it resets at {next_period(reset, period).isoformat()})"


PERIOD_NAMES = {"daily": "UTC day", "weekly": "UTC week", "monthly": "UTC month"}


def next_period(reset, start):
    """Return the start of the period after the one starting at ``start`` (UTC)."""
    if reset == "daily":
        return start + timedelta(days=1)
    if reset == "weekly":
        return start + timedelta(days=7)
    year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
    return start.replace(year=year, month=month, day=1)


def insufficient_credits(available_nanos, hold_nanos):
    """Return the 402 error: the available amount, the hold, and what to do."""
    return InsufficientCredits(
        f"Insufficient credits: {format_dollars(max(available_nanos, 0))} available (balance "
        f"minus the holds of requests in flight), but this request needs a hold of "
        f"{format_dollars(hold_nanos)}, its worst-case cost at max_tokens. Lower max_tokens, "
        f"or add credits.")

