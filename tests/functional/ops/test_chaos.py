"""The chaos run (docs/RELIABILITY.md): its schedule replays from the seed, each invariant
check counts a breach fed to it, and a short seeded run against the real gateway ends with
zero violations."""
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

import chaos_checks as checks
from chaos_clients import Observation
from chaos_plan import FAULT_MEAN_GAP_S, build_plan, fingerprint
from chaos_upstream import marker, parse_marker

RUN_SEED, RUN_DURATION_S = 13, 40
ORG_IDS = {0: 101, 1: 102}


def obs(**fields):
    base = dict(action=1, sub=0, kind="chat", org=0, stream=False, key_kind="current",
                t_start=10.0, t_headers=10.5, t_end=11.0, status=200, outcome="complete",
                complete=True, gen_id="gen-" + "a" * 24, cost=Decimal("0.000123"))
    return Observation(**{**base, **fields})


def event(**fields):
    base = dict(id="gen-" + "a" * 24, org_id=101, status="completed", cost_nanos=123000,
                hold_nanos=10 ** 7, http_status=200, prompt_tokens=10, completion_tokens=5)
    return {**base, **fields}


def balance(**fields):
    base = dict(id=101, name="o", in_flight_limit=2, in_flight=1, balance_nanos=100,
                held_nanos=40, leases=1, lease_holds=40)
    return {**base, **fields}


# -- the schedule --------------------------------------------------------------------------


def test_the_same_seed_draws_the_same_schedule():
    first, again = build_plan(5, 60), build_plan(5, 60)
    assert first == again
    assert fingerprint(first) == fingerprint(again)
    assert fingerprint(build_plan(6, 60)) != fingerprint(first)


def test_a_short_schedule_meets_every_fault_kind_and_client_kind():
    plan = build_plan(RUN_SEED, RUN_DURATION_S)
    assert {f.kind for f in plan.faults} == set(FAULT_MEAN_GAP_S)
    assert {a.kind for a in plan.actions} >= {"chat", "stream", "disconnect", "slow_reader",
                                              "bad_body", "burst", "stale_key"}
    assert all(0 < f.t_s < RUN_DURATION_S for f in plan.faults)


def test_a_request_marker_names_its_action_and_org():
    body = {"messages": [{"role": "user", "content": marker(42, 3, 1) + " hello"}]}
    assert parse_marker(body) == (42, 3, 1)
    assert parse_marker({"messages": [{"role": "user", "content": "hello"}]}) is None


# -- each check counts a breach ------------------------------------------------------------


@pytest.mark.parametrize("row, invariant", [
    (balance(in_flight=3, leases=3, held_nanos=90, lease_holds=90), "inflight_above_limit"),
    (balance(in_flight=2, leases=1), "holds_leases_mismatch"),
    (balance(held_nanos=50), "holds_leases_mismatch"),
    (balance(balance_nanos=-1, held_nanos=0, lease_holds=0), "balance_below_zero"),
    (balance(balance_nanos=30), "balance_below_holds"),
])
def test_a_balance_snapshot_breach_is_counted(row, invariant):
    seen = checks.Violations()
    checks.check_balances([row], seen, {}, 5.0, 0.0)
    assert seen.counts[invariant] == 1


def test_a_sound_balance_snapshot_counts_nothing_and_records_the_peak():
    seen, peaks = checks.Violations(), {}
    checks.check_balances([balance(in_flight=2, leases=2, held_nanos=80, lease_holds=80)], seen,
                          peaks, 5.0, 0.0)
    assert seen.total == 0
    assert peaks == {"o": 2}


def test_leases_and_pending_events_left_after_quiescence_are_counted():
    seen = checks.Violations()
    checks.check_quiet([("gen-1", 101, "2026-01-01")], [("gen-2", 101, "2026-01-01")], seen)
    assert seen.counts["lease_left"] == 1 and seen.counts["pending_event_left"] == 1


def test_reconcile_exit_status_is_checked():
    seen = checks.Violations()
    checks.check_reconcile(0, "ok", seen)
    checks.check_reconcile(1, "OFF: o", seen)
    assert seen.counts["reconcile_off"] == 1


@pytest.mark.parametrize("o, events, invariant", [
    (obs(), {}, "complete_without_event"),
    (obs(gen_id=None), {}, "complete_without_event"),
    (obs(), {"gen-" + "a" * 24: event(org_id=102)}, "complete_without_event"),
    (obs(cost=Decimal("0.000124")), {"gen-" + "a" * 24: event()}, "complete_cost_mismatch"),
    (obs(cost=None), {"gen-" + "a" * 24: event()}, "complete_cost_mismatch"),
])
def test_a_complete_answer_without_its_exact_event_is_counted(o, events, invariant):
    seen = checks.Violations()
    checks.check_complete([o], events, ORG_IDS, seen)
    assert seen.counts[invariant] == 1
    assert seen.total == 1


def test_a_complete_answer_matching_its_event_exactly_counts_nothing():
    seen = checks.Violations()
    # 0.000123 USD is 123000 nano-dollars: compared as decimals, never as floats
    checks.check_complete([obs(cost=Decimal("0.0001230"))], {"gen-" + "a" * 24: event()},
                          ORG_IDS, seen)
    assert seen.total == 0


ABANDONED = {"gen-" + "a" * 24: event(status="abandoned", cost_nanos=90000)}


@pytest.mark.parametrize("kills", [
    [],                          # no worker was killed
    [(1, 5.0, 5.1)],             # a worker of the other host
    [(0, 5.0, 5.1)],             # of its host, before the request was sent
    [(0, 40.0, 40.1)],           # of its host, long after its answer (past the slack)
])
def test_an_abandoned_complete_answer_is_counted_unless_a_worker_of_its_host_was_killed(kills):
    """docs/METERING.md allows "billed" to differ from "told" only for a killed worker's
    answers: an answer whose event the sweeper closed is a breach unless a worker of the host
    that answered it was killed while it ran or its settlement was outstanding."""
    seen = checks.Violations()
    checks.check_complete([obs(gateway=0)], ABANDONED, ORG_IDS, seen, kills,
                          settle_slack_s=12.0)
    assert seen.counts["complete_cost_mismatch"] == 1 and seen.total == 1


@pytest.mark.parametrize("kill", [(0, 10.5, 10.6), (0, 11.2, 11.3), (0, 9.0, 10.0)])
def test_an_abandoned_complete_answer_of_a_killed_workers_host_counts_nothing(kill):
    seen = checks.Violations()
    checks.check_complete([obs(gateway=0)], ABANDONED, ORG_IDS, seen, [kill],
                          settle_slack_s=12.0)
    assert seen.total == 0


def test_one_generation_id_on_two_answers_is_counted():
    seen = checks.Violations()
    checks.check_complete([obs(complete=False), obs(sub=1, complete=False)], {}, ORG_IDS, seen)
    assert seen.counts["generation_id_reused"] == 2


def test_an_admitted_request_answered_without_generation_id_is_counted():
    seen = checks.Violations()
    answers = [obs(status=500, gen_id=None, complete=False),
               obs(action=2, status=429, gen_id=None, complete=False)]
    checks.check_answers(answers, {}, {(1, 0)}, seen)
    assert seen.counts["admitted_without_generation_id"] == 1


def test_an_error_answer_with_a_billed_event_is_counted():
    seen = checks.Violations()
    gid = "gen-" + "a" * 24
    checks.check_answers([obs(status=502, complete=False)], {gid: event()}, set(), seen)
    checks.check_answers([obs(status=502, complete=False)], {gid: event(cost_nanos=0)}, set(),
                         seen)
    assert seen.counts["error_billed"] == 1


def test_a_revoked_or_unknown_key_served_is_counted():
    seen = checks.Violations()
    early = obs(key_kind="revoked", key_revoked_at=9.0)           # within the grace
    late = obs(key_kind="revoked", key_revoked_at=5.0)            # 5 s after revocation
    refused = obs(key_kind="revoked", key_revoked_at=5.0, status=403)
    unknown = obs(key_kind="unknown")
    checks.check_keys([early, late, refused, unknown], 3.0, seen)
    assert seen.counts["bad_key_served"] == 2


def test_a_200_well_inside_a_maintenance_window_is_counted():
    from chaos import FaultRecord
    log = [FaultRecord("maintenance", 1, 4.0, 5.0, "done", state="on"),
           FaultRecord("maintenance", 2, 20.0, 21.0, "done", state="off")]
    windows = checks.maintenance_windows(log)
    assert windows == [(5.0, 20.0)]
    seen = checks.Violations()
    inside = obs(t_start=10.0, t_headers=10.5)
    too_early = obs(t_start=5.5, t_headers=5.6)     # workers may not have polled yet
    after_off = obs(t_start=19.0, t_headers=20.5)   # answered once off had begun
    told = obs(t_start=10.0, t_headers=10.5, status=503)
    checks.check_maintenance([inside, too_early, after_off, told], windows, 2.5, seen)
    assert seen.counts["maintenance_ignored"] == 1


def test_a_refused_body_served_is_counted():
    seen = checks.Violations()
    checks.check_bad_requests([obs(kind="bad_body", bad_body="empty_messages"),
                               obs(kind="bad_body", status=400)], seen)
    assert seen.counts["bad_request_served"] == 1


class Record:
    def __init__(self, action, org, start, end, completed=True, closed_at=None):
        self.json = {"messages": [{"content": marker(action, 0, org)}]}
        self.received_at, self.sent_at = start, [end]
        self.completed, self.closed_at = completed, closed_at


def test_more_requests_of_an_org_at_the_backends_than_its_limit_is_counted():
    records = [Record(1, 0, 0.0, 2.0), Record(2, 0, 1.0, 3.0), Record(3, 0, 1.5, 1.6),
               Record(4, 1, 1.5, 1.6),                          # another org
               Record(5, 0, 1.2, 9.0, completed=False),         # cut short: no bound
               Record(6, 0, 1.2, 9.0, closed_at=1.3)]
    spans = checks.backend_intervals(records, parse_marker)
    seen = checks.Violations()
    peaks = checks.check_backend_concurrency(spans, {0: 2, 1: 1}, seen, 0.0)
    assert peaks == {0: 3, 1: 1}
    assert seen.counts["backend_concurrency_above_limit"] == 1


def test_every_invariant_appears_in_the_figures_even_at_zero():
    seen = checks.Violations()
    assert list(seen.counts) == list(checks.INVARIANTS)
    with pytest.raises(KeyError):
        seen.add("no_such_invariant", "x")


# -- a short run -----------------------------------------------------------------------------


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_a_short_seeded_chaos_run_ends_with_zero_violations():
    script = Path(checks.__file__).with_name("chaos.py")  # tests/support/chaos.py
    proc = subprocess.Popen([sys.executable, str(script), "--seed", str(RUN_SEED),
                             "--duration", str(RUN_DURATION_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the run stops its Postgres cluster and gateways on SIGTERM
        out, err = proc.communicate(timeout=60)
    print(out[-12000:])
    print(err[-4000:], file=sys.stderr)
    assert "Violations (by invariant)" in out
    assert proc.returncode == 0
