"""The figures of a chaos run: requests by kind and outcome, faults by kind, violations by
invariant, and the evidence of each violation (docs/RELIABILITY.md, "Reading the figures")."""
import re
import sys
from collections import Counter, defaultdict
from decimal import Decimal

import chaos_checks as checks
from chaos_plan import ORGS, fingerprint

UPSTREAM_FAULTS = ("reset", "error_500", "hang", "garbage", "usage_null", "usage_negative",
                   "usage_string", "usage_huge")
CREDITS_SQL = """
SELECT o.name, b.balance_nanos,
       (SELECT count(*) FROM credit_grants g WHERE g.org_id = o.id) AS grants,
       (SELECT count(*) FROM usage_events e WHERE e.org_id = o.id) AS events,
       (SELECT count(*) FROM usage_events e WHERE e.org_id = o.id AND e.cost_nanos > 0) AS billed
  FROM orgs o JOIN credit_balances b ON b.org_id = o.id ORDER BY o.id
"""


def print_report(run, out=sys.stdout):
    """Print the figures of ``run`` (a finished :class:`chaos.ChaosRun`)."""
    p = run.plan
    print(f"\nKiln chaos run: seed={p.seed} duration={p.duration_s:g}s rate={p.rate_per_s:g}/s "
          f"schedule={fingerprint(p)} actions={len(p.actions)} "
          f"wall={run.traffic_end - run.t0:.1f}s", file=out)
    print(_requests_table(run.observations), file=out)
    print(_faults_table(run.plan, run.fault_log, run.backends.served), file=out)
    peaks = ", ".join(f"{run.org_names[i]} {run.peaks.get(run.org_names[i], 0)}"
                      f"/{run.backend_peaks.get(i, 0)}/{limit}"
                      for i, (limit, _) in enumerate(ORGS))
    print(f"\nIn-flight peak (sampled / at the backends / limit): {peaks}", file=out)
    print(f"Samples: {dict(run.samples)}", file=out)
    bursts = defaultdict(set)
    for o in run.observations:
        if o.kind == "burst":
            bursts[o.action].add(o.status)
    print(f"Bursts: {len(bursts)}, of which {sum(429 in s for s in bursts.values())} met a "
          f"429", file=out)
    print("Orgs at the end: " + ", ".join(
        f"{r['name']} balance {Decimal(r['balance_nanos']) / checks.NANOS_PER_USD} USD, "
        f"{r['grants']} grants, {r['events']} usage events ({r['billed']} billed)"
        for r in run.credits), file=out)
    print(_log_figures(run.gateways.logs()), file=out)
    print(_violations_table(run.violations), file=out)
    if not run.gateways_alive:
        print("note: a gunicorn master exited during the run", file=out)
    for note in run.notes:
        print(f"note: {note}", file=out)


def print_evidence(run, out=sys.stdout):
    """Print each kept violation with the faults around it and its gateway log lines."""
    logs = run.gateways.logs()
    for name, items in run.violations.evidence.items():
        for text, span in items:
            print(f"VIOLATION {name}: {text}", file=out)
            if span is not None:
                start, end = span[0] - run.t0, span[1] - run.t0
                print(f"    seen from t={start:.2f}s to t={end:.2f}s", file=out)
                for f in run.fault_log:
                    if f.t_start - 5 <= span[1] and f.t_end + 5 >= span[0]:
                        fault = f"{f.kind} {f.state}".strip()
                        print(f"    fault {fault} ({f.result}) t={f.t_start - run.t0:.2f}s.."
                              f"{f.t_end - run.t0:.2f}s {f.detail}".rstrip(), file=out)
            for gid in re.findall(r"gen-[0-9a-f]{24}", text)[:1]:
                for line in _log_lines(logs, gid):
                    print(f"    gateway log: {line}", file=out)


def _requests_table(observations):
    by_kind = defaultdict(Counter)
    for o in observations:
        by_kind[o.kind][o.outcome] += 1
    outcomes = sorted({o.outcome for o in observations}, key=_outcome_order)
    lines = ["\nRequests (by kind and outcome)",
             f"{'kind':<12} {'total':>6} " + " ".join(f"{c:>{max(6, len(c))}}" for c in outcomes)]
    for kind in sorted(by_kind):
        row = by_kind[kind]
        lines.append(f"{kind:<12} {sum(row.values()):>6} "
                     + " ".join(f"{row[c]:>{max(6, len(c))}}" for c in outcomes))
    total = Counter(o.outcome for o in observations)
    lines.append(f"{'all':<12} {len(observations):>6} "
                 + " ".join(f"{total[c]:>{max(6, len(c))}}" for c in outcomes))
    return "\n".join(lines)


def _outcome_order(name):
    order = ["complete", "stream_error", "cut", "no_usage"]
    return (order.index(name), name) if name in order else (len(order), name)


def _faults_table(plan, fault_log, served):
    planned = Counter()
    for a in plan.actions:
        if a.kind != "bad_body":
            planned[a.upstream.kind] += a.size
    lines = ["\nFaults (by kind)", f"{'fault':<24} {'planned':>8} {'done':>6} {'refused':>8} "
             f"{'failed':>7}"]
    for kind in UPSTREAM_FAULTS:
        lines.append(f"{'upstream ' + kind:<24} {planned[kind]:>8} {served[kind]:>6} "
                     f"{0:>8} {0:>7}")
    scheduled = Counter(f.kind + (f" {f.state}" if f.state else "") for f in plan.faults)
    results = defaultdict(Counter)
    for f in fault_log:
        results[f.kind + (f" {f.state}" if f.state else "")][f.result] += 1
    for kind in sorted(scheduled):
        r = results[kind]
        lines.append(f"{kind:<24} {scheduled[kind]:>8} {r['done']:>6} {r['refused']:>8} "
                     f"{r['failed']:>7}")
    return "\n".join(lines)


def _violations_table(violations):
    lines = ["\nViolations (by invariant)"]
    for name in checks.INVARIANTS:
        lines.append(f"{name:<34} {violations.counts[name]:>6}")
    lines.append(f"{'total':<34} {violations.total:>6}")
    return "\n".join(lines)


def _log_figures(logs):
    text = "\n".join(logs)
    figures = {"settlement failed": text.count("settlement failed"),
               "sweeps that closed generations": len(re.findall(r"sweeper closed \d+", text)),
               "database unavailable": text.count("database unavailable"),
               "worker timeouts": text.count("WORKER TIMEOUT")}
    # The exception that ends each traceback: its first unindented line after the header.
    ends = Counter(m.group(1) for m in re.finditer(
        r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*([A-Za-z_.]+(?:Error|Exception|"
        r"Exit|Interrupt)?)", text))
    chain = ", ".join(f"{k} {v}" for k, v in sorted(ends.items())) or "none"
    return ("Gateway logs: " + ", ".join(f"{k} {v}" for k, v in figures.items())
            + f"\nGateway log tracebacks (by exception): {chain}")


def _log_lines(logs, gid):
    out = []
    for log in logs:
        for line in log.splitlines():
            if gid in line:
                out.append(line[:400])
    return out[:4]


