"""Invariants of a chaos run, as plain functions over what the run observed.

Each check takes rows read from the documented tables (README "Administration";
gateway/models.py) or the clients' observations, and records every breach in :class:`Violations`
with its evidence. Nothing here talks to a server, so tests can feed each check a breach and see
it counted (tests/functional/ops/test_chaos.py).
"""
from collections import Counter, defaultdict
from decimal import Decimal

NANOS_PER_USD = Decimal(10 ** 9)

INVARIANTS = {
    "inflight_above_limit": "an org's in-flight count or lease rows above its limit (sampled)",
    "holds_leases_mismatch": "credit_balances.in_flight/held_nanos differ from the lease rows "
                             "in one snapshot (sampled)",
    "balance_below_zero": "a balance below zero (sampled)",
    "balance_below_holds": "a balance below the holds of requests in flight (sampled)",
    "backend_concurrency_above_limit": "more requests of one org running at the backends at "
                                       "once than its limit",
    "lease_left": "a lease left after quiescence, one lease TTL and `kiln sweep`",
    "pending_event_left": "a pending usage event left after quiescence, one TTL and a sweep",
    "reconcile_off": "`kiln credits reconcile` exited non-zero",
    "complete_without_event": "a complete response without exactly one usage event",
    "complete_cost_mismatch": "a complete response whose usage.cost differs from its event's",
    "generation_id_reused": "one generation id on two responses",
    "admitted_without_generation_id": "an answer without X-Neocloud-Generation-Id to a request "
                                      "that reached a backend (so was admitted)",
    "error_billed": "an error answer (4xx/5xx) whose usage event has a cost",
    "bad_key_served": "a 200 for an unknown key, or for a key revoked a cache TTL earlier",
    "maintenance_ignored": "a 200 decided while maintenance mode had been on for a while",
    "bad_request_served": "a 200 for a body the request contract refuses",
}
EVIDENCE_PER_INVARIANT = 5

BALANCES_SQL = """
SELECT o.id, o.name, o.in_flight_limit, b.in_flight, b.balance_nanos, b.held_nanos,
       (SELECT count(*) FROM in_flight f WHERE f.org_id = o.id) AS leases,
       (SELECT coalesce(sum(f.hold_nanos), 0) FROM in_flight f WHERE f.org_id = o.id) AS lease_holds
  FROM orgs o JOIN credit_balances b ON b.org_id = o.id
 ORDER BY o.id
"""
LEASES_SQL = "SELECT generation_id, org_id, expires_at FROM in_flight ORDER BY generation_id"
PENDING_SQL = ("SELECT id, org_id, started_at FROM usage_events WHERE status = 'pending' "
               "ORDER BY id")
EVENTS_SQL = ("SELECT id, org_id, status, cost_nanos, hold_nanos, http_status, error_code, "
              "prompt_tokens, completion_tokens FROM usage_events WHERE id = ANY(%s)")


class Violations:
    """Counts per invariant (every invariant listed, zero or not) and a little evidence each."""

    def __init__(self):
        self.counts = Counter({name: 0 for name in INVARIANTS})
        self.evidence = defaultdict(list)

    def add(self, invariant, evidence, span=None):
        """Count one breach of ``invariant``; keep ``evidence`` (text) and ``span`` (monotonic
        start and end seconds of what was seen, to line it up with the faults) for the first
        few."""
        if invariant not in INVARIANTS:
            raise KeyError(invariant)
        self.counts[invariant] += 1
        if len(self.evidence[invariant]) < EVIDENCE_PER_INVARIANT:
            self.evidence[invariant].append((evidence, span))

    @property
    def total(self):
        return sum(self.counts.values())


def check_balances(rows, violations, peaks, now, t0):
    """Check one snapshot of every org's balance row against its lease rows.

    :param rows: mappings with the columns of :data:`BALANCES_SQL`.
    :param peaks: ``{org name: highest in-flight seen}``, updated.
    :param now: ``time.monotonic()`` of the snapshot; ``t0`` that of the run's start.
    """
    at_s, span = now - t0, (now, now)
    for r in rows:
        name = r["name"]
        peaks[name] = max(peaks.get(name, 0), r["in_flight"], r["leases"])
        limit = r["in_flight_limit"]
        if limit is not None and max(r["in_flight"], r["leases"]) > limit:
            violations.add("inflight_above_limit", f"t={at_s:.1f}s org {name}: in_flight="
                           f"{r['in_flight']} leases={r['leases']} limit={limit}", span=span)
        if r["in_flight"] != r["leases"] or r["held_nanos"] != r["lease_holds"]:
            violations.add("holds_leases_mismatch", f"t={at_s:.1f}s org {name}: in_flight="
                           f"{r['in_flight']} leases={r['leases']} held_nanos={r['held_nanos']} "
                           f"lease holds={r['lease_holds']}", span=span)
        if r["balance_nanos"] < 0:
            violations.add("balance_below_zero", f"t={at_s:.1f}s org {name}: balance_nanos="
                           f"{r['balance_nanos']}", span=span)
        if r["balance_nanos"] < r["held_nanos"]:
            violations.add("balance_below_holds", f"t={at_s:.1f}s org {name}: balance_nanos="
                           f"{r['balance_nanos']} held_nanos={r['held_nanos']}", span=span)


def _span(observation):
    return observation.t_start, observation.t_end


def check_quiet(leases, pending, violations):
    """After quiescence, one lease TTL and a sweep: no lease row and no pending event."""
    for row in leases:
        violations.add("lease_left", f"lease {row[0]} of org {row[1]} expires {row[2]}")
    for row in pending:
        violations.add("pending_event_left", f"usage event {row[0]} of org {row[1]} started "
                       f"{row[2]} is still pending")


def check_reconcile(returncode, output, violations):
    """``kiln credits reconcile`` must exit 0."""
    if returncode != 0:
        violations.add("reconcile_off", f"exit {returncode}: {output.strip()[-1500:]}")


def _where(o):
    return (f"action {o.action}.{o.sub} ({o.kind}, stream={o.stream}, upstream={o.upstream}, "
            f"gen {o.gen_id})")


def check_complete(observations, events, org_ids, violations, kills=(), settle_slack_s=0.0):
    """Every complete response has exactly one usage event, of its org, costing its usage.cost
    (unless its worker was killed before the settlement committed: then ``abandoned``).

    Which worker served a request is not known here (the client's connection is closed by the
    time of a kill that leaves it to the sweeper), so an ``abandoned`` event is taken for the
    killed worker's only if a worker of the host that answered it was killed between the
    request's start and ``settle_slack_s`` after its answer ended; any other is a breach.

    :param observations: :class:`chaos_clients.Observation` list.
    :param events: ``{generation id: row}`` with the columns of :data:`EVENTS_SQL`.
    :param org_ids: ``{org index: org id}``.
    :param kills: ``[(host index, kill's start, kill's end)]`` (monotonic seconds).
    :param settle_slack_s: how long after its answer a settlement may still be outstanding.
    """
    seen = Counter(o.gen_id for o in observations if o.gen_id)
    for o in observations:
        if o.gen_id and seen[o.gen_id] > 1:
            violations.add("generation_id_reused", f"{_where(o)}: on {seen[o.gen_id]} answers",
                           span=_span(o))
        if not o.complete:
            continue
        row = events.get(o.gen_id) if o.gen_id else None
        if row is None or row["org_id"] != org_ids[o.org]:
            found = dict(row) if row else None
            violations.add("complete_without_event", f"{_where(o)}: no usage event of org "
                           f"{org_ids[o.org]} (found {found})", span=_span(o))
            continue
        if row["status"] == "abandoned":
            # Answered, then its worker was killed before the settlement committed (a few
            # milliseconds after the answer): the sweeper billed the progress recorded
            # (docs/METERING.md). A live worker renews the lease until its settlement commits.
            if not _killed_while_outstanding(o, kills, settle_slack_s):
                violations.add("complete_cost_mismatch",
                               f"{_where(o)}: usage.cost={o.cost} but the sweeper closed its "
                               f"event (abandoned, cost={row['cost_nanos']} nanos) and no "
                               f"worker of host {o.gateway} was killed while it was "
                               f"outstanding", span=_span(o))
            continue
        billed = Decimal(row["cost_nanos"]) / NANOS_PER_USD
        if o.cost is None or billed != o.cost:
            violations.add("complete_cost_mismatch",
                           f"{_where(o)}: usage.cost={o.cost} but the event says cost={billed} "
                           f"status={row['status']} tokens={row['prompt_tokens']}/"
                           f"{row['completion_tokens']}", span=_span(o))


def _killed_while_outstanding(o, kills, settle_slack_s):
    return any(host == o.gateway and o.t_start <= end and start <= o.t_end + settle_slack_s
               for host, start, end in kills)


def check_answers(observations, events, reached, violations):
    """Every admitted request's answer names its usage event; an error answer costs nothing.

    :param events: as for :func:`check_complete`.
    :param reached: ``{(action id, sub)}`` of the requests that reached a backend.
    """
    for o in observations:
        if o.status is None:
            continue
        if not o.gen_id and (o.action, o.sub) in reached:
            violations.add("admitted_without_generation_id",
                           f"{_where(o)}: HTTP {o.status} code={o.error_code}; the backend got "
                           f"the request, the answer names no generation", span=_span(o))
        row = events.get(o.gen_id) if o.gen_id else None
        # A reply too large to relay is billed what was generated (docs/METERING.md).
        if o.status >= 400 and row is not None and row["cost_nanos"] != 0 \
                and row.get("error_code") != "upstream_too_large":
            violations.add("error_billed", f"{_where(o)}: HTTP {o.status}, event status="
                           f"{row['status']} cost_nanos={row['cost_nanos']}", span=_span(o))


def check_keys(observations, grace_s, violations):
    """A 200 never answers an unknown key, nor a key revoked ``grace_s`` before the request."""
    for o in observations:
        if o.status != 200:
            continue
        if o.key_kind == "unknown":
            violations.add("bad_key_served", f"{_where(o)}: unknown key answered 200",
                           span=_span(o))
        elif o.key_kind == "revoked" and o.t_start > o.key_revoked_at + grace_s:
            violations.add("bad_key_served", f"{_where(o)}: key revoked "
                           f"{o.t_start - o.key_revoked_at:.1f}s before the request, 200",
                           span=_span(o))


def maintenance_windows(fault_log):
    """Return ``[(on done, off started)]`` from the executed faults, in order."""
    windows, on_done = [], None
    for f in fault_log:
        if f.kind != "maintenance" or f.result != "done":
            continue
        if f.state == "on" and on_done is None:
            on_done = f.t_end
        elif f.state == "off" and on_done is not None:
            windows.append((on_done, f.t_start))
            on_done = None
    if on_done is not None:
        windows.append((on_done, float("inf")))
    return windows


def check_maintenance(observations, windows, grace_s, violations):
    """No 200 for a request sent ``grace_s`` after maintenance went on, answered before off."""
    for o in observations:
        if o.status != 200 or o.t_headers is None:
            continue
        for on, off in windows:
            if o.t_start > on + grace_s and o.t_headers < off:
                violations.add("maintenance_ignored", f"{_where(o)}: sent "
                               f"{o.t_start - on:.1f}s after maintenance on, answered 200",
                               span=_span(o))


def check_bad_requests(observations, violations):
    """A body the contract refuses never gets a 200."""
    for o in observations:
        if o.kind == "bad_body" and o.status == 200:
            violations.add("bad_request_served", f"{_where(o)}: {o.bad_body} answered 200",
                           span=_span(o))


def backend_intervals(records, parse_marker):
    """Return ``{org index: [(start, end, action)]}``: when each request certainly held a lease.

    A backend receives a request only after its admission, and the gateway settles only after
    it has read the last byte the backend sent; so from the request's arrival to the backend's
    last send of a reply that ran to its end, the request held an in-flight lease. Replies cut
    short (the gateway hung up first) give no such bound and are left out.
    """
    spans = defaultdict(list)
    for r in records:
        found = parse_marker(r.json) if isinstance(r.json, dict) else None
        if found is None or not r.completed or r.closed_at is not None:
            continue
        end = r.sent_at[-1] if r.sent_at else r.received_at
        spans[found[2]].append((r.received_at, max(end, r.received_at), f"{found[0]}.{found[1]}"))
    return spans


def check_backend_concurrency(spans, limits, violations, t0):
    """At no instant do more requests of an org run at the backends than its limit.

    :param spans: :func:`backend_intervals`.
    :param limits: ``{org index: in-flight limit}``.
    """
    peaks = {}
    for org, intervals in spans.items():
        points = sorted([(s, 0, a) for s, _, a in intervals] + [(e, 1, a) for _, e, a in intervals])
        running, peak = set(), 0
        for at, is_end, action in points:
            if is_end:
                running.discard(action)
                continue
            running.add(action)
            peak = max(peak, len(running))
            if len(running) > limits[org]:
                violations.add("backend_concurrency_above_limit",
                               f"t={at - t0:.2f}s org {org}: {len(running)} requests at the "
                               f"backends (limit {limits[org]}): {sorted(running)}")
        peaks[org] = peak
    return peaks
