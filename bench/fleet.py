"""A fleet of backends, measured (docs/ROUTING.md): retries before the first byte, and
prefix affinity. Prints the tables of bench/RESULTS.md, section "Fleet".

Run: ``.venv/bin/python bench/fleet.py`` (Postgres on 127.0.0.1:5432, as for the tests).

1. Faults: three scripted fake upstreams behind one model id (tests/support/fake_upstream.py). One
   refuses connections the whole run (its port is closed); one answers 500 before its headers
   during the first third of the requests; one hangs before its headers during the second third
   (first-byte timeout 1 s), which begins once the first is back from its cool-down (the probe
   does not bring back a backend whose chat requests failed). ``--requests`` requests, half
   of them streams, ``--concurrency`` at a time, through gunicorn. The same run against three
   healthy upstreams is the baseline of the added latency. Printed: client-visible failures,
   usage events and the USD debited (each request billed once), attempts per request,
   latency p50/p99 and what the faults add.
2. Prefix affinity: ``--conversations`` conversations of ``--turns`` turns each, all at once
   (turns of one conversation in order, each carrying the whole history), over three healthy
   upstreams that take 50 ms per answer, once per ``--load-bounds`` value (the catalog's
   ``load_bound``). Printed: the share of turns served by their conversation's first backend,
   and the spread of turns over backends (max/mean).
"""
import argparse
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from factories import write_fleet_catalog  # noqa: E402
from fake_upstream import FakeUpstream, Hang, default_script, error_reply  # noqa: E402
from gateway_proc import (Gateway, balance_nanos, create_database, drop_database,  # noqa: E402
                          free_port, make_org, metric, migrate, wait_until)

CHAT = "/v1/chat/completions"


class Sick:
    """A responder that fails chat requests with ``script`` while ``on`` is set."""

    def __init__(self, script, responder=default_script):
        self.script, self.responder, self.on = script, responder, threading.Event()

    def __call__(self, record):
        if self.on.is_set() and record.method == "POST":
            return self.script
        return self.responder(record)


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_request(base_url, key, stream, messages, timeout_s=60):
    """Send one chat request and read all of it; return ``(ok, seconds, generation id)``."""
    body = {"model": "fleet-model", "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    try:
        r = requests.post(base_url + CHAT, json=body, timeout=timeout_s,
                          headers={"Authorization": f"Bearer {key}"})
        data = r.content
    except requests.RequestException:
        return False, time.monotonic() - started, None
    ok = r.status_code == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
    return ok, time.monotonic() - started, r.headers.get("X-Neocloud-Generation-Id")


class Bench:
    """A database, three fake upstreams and a gateway (started per scenario)."""

    def __init__(self, args):
        self.args = args
        self.db_name = f"kiln_bench_fleet_{uuid.uuid4().hex[:8]}"
        self.url = create_database(self.db_name)
        migrate(self.url)
        self.engine = sa.create_engine(self.url)
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-bench-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)

    def gateway(self, urls, **catalog):
        path = write_fleet_catalog(self.workdir / f"models-{uuid.uuid4().hex[:6]}.toml", urls,
                                   **catalog)
        env = {"KILN_DATABASE_URL": self.url, "KILN_MODELS": str(path),
               "KILN_LOG_REQUESTS": "false", "KILN_PROBE_INTERVAL_S": "1",
               "KILN_SLOT_DIR": str(self.workdir / "slots")}
        return Gateway(env, workers=self.args.workers).start(timeout_s=60)

    def org(self):
        return make_org(self.engine, f"bench-{uuid.uuid4().hex[:8]}", usd="1000",
                        limit=self.args.concurrency * 4)

    def close(self):
        self.engine.dispose()
        drop_database(self.db_name)

    # -- 1. faults -------------------------------------------------------------------------

    def run_requests(self, gw, org, on_third=None):
        """``--requests`` requests, every other one a stream; ``on_third(i)`` at each third."""
        n, results = self.args.requests, []
        messages = [{"role": "user", "content": "Hello"}]
        for third in range(3):
            if on_third:
                on_third(third)
            count = n // 3 + (1 if third < n % 3 else 0)
            with ThreadPoolExecutor(self.args.concurrency) as pool:
                results += pool.map(
                    lambda i: one_request(gw.base_url, org.key, i % 2 == 0, messages),
                    range(len(results), len(results) + count))
        return results

    def faults(self):
        healthy = [FakeUpstream().start() for _ in range(3)]
        try:
            gw = self.gateway([f.base_url for f in healthy], timeouts="first_byte_s = 1")
            try:
                baseline = self.run_requests(gw, self.org())
            finally:
                gw.stop()
        finally:
            for f in healthy:
                f.stop()
        return baseline, self.faulty()

    def faulty(self):
        erring, hanging = Sick(error_reply(500, "boom")), Sick([Hang()])
        fakes = [FakeUpstream(default=erring).start(), FakeUpstream(default=hanging).start()]
        urls = [f"http://127.0.0.1:{free_port()}/v1"] + [f.base_url for f in fakes]
        phases = {0: erring.on, 1: hanging.on}

        def on_third(third):
            erring.on.clear(), hanging.on.clear()
            if third == 1:  # the probe does not bring back a backend whose chat failed
                wait_until(lambda: metric(gw.base_url, "kiln_backend_state",
                                          backend=fakes[0].base_url) < 2, timeout_s=70)
            if third in phases:
                phases[third].set()
        try:
            gw = self.gateway(urls, timeouts="first_byte_s = 1")
            org = self.org()
            before = balance_nanos(self.engine, org.id)[0]
            try:
                results = self.run_requests(gw, org, on_third)
            finally:
                gw.stop()
        finally:
            for f in fakes:
                f.stop()
        return results, self.billing(org, before, results)

    def billing(self, org, before, results):
        """Usage events of the run: attempts per request, statuses, and what was debited."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT status, attempts, cost_nanos FROM usage_events "
                                        "WHERE org_id = :o"), {"o": org.id}).all()
        debited = before - balance_nanos(self.engine, org.id)[0]
        return {"events": len(rows), "completed": sum(r[0] == "completed" for r in rows),
                "attempts": [len(json.loads(r[1] or "[]")) for r in rows],
                "cost_sum": sum(r[2] or 0 for r in rows), "debited": debited}

    # -- 2. prefix affinity ----------------------------------------------------------------

    def affinity(self, load_bound):
        slow = functools.partial(default_script, hold_s=0.05)
        fakes = [FakeUpstream(default=slow).start() for _ in range(3)]
        try:
            gw = self.gateway([f.base_url for f in fakes], routing="prefix-affinity",
                              load_bound=load_bound)
            org = self.org()
            try:
                with ThreadPoolExecutor(self.args.conversations) as pool:
                    gids = list(pool.map(lambda c: self.conversation(gw, org, c),
                                         range(self.args.conversations)))
            finally:
                gw.stop()
        finally:
            for f in fakes:
                f.stop()
        return self.backends_of(gids)

    def conversation(self, gw, org, number):
        messages = [{"role": "system", "content": f"You are assistant number {number}."},
                    {"role": "user", "content": f"Conversation {number}: tell me a story."}]
        gids = []
        for turn in range(self.args.turns):
            ok, _, gid = one_request(gw.base_url, org.key, turn % 2 == 0, messages)
            gids.append(gid if ok else None)
            messages += [{"role": "assistant", "content": "Hello from the fake upstream!"},
                         {"role": "user", "content": f"And then ({turn})?"}]
        return gids

    def backends_of(self, conversations):
        with self.engine.connect() as conn:
            rows = dict(conn.execute(sa.text("SELECT id, backend FROM usage_events")).all())
        return [[rows.get(g) for g in gids] for gids in conversations]


def report_faults(baseline, faulty):
    results, bill = faulty
    base_s = [s for _, s, _ in baseline]
    fault_s = [s for _, s, _ in results]
    attempts = Counter(bill["attempts"])
    p50, p99 = percentile(fault_s, 0.50), percentile(fault_s, 0.99)
    b50, b99 = percentile(base_s, 0.50), percentile(base_s, 0.99)
    print(f"\n### Faults: {len(results)} requests (half streams), 3 backends: one refusing, "
          f"one 500 (first third), one hanging (second third)\n")
    print("| figure | value |\n|---|---|")
    print(f"| client-visible failures | {sum(not ok for ok, _, _ in results)} |")
    print(f"| usage events / completed | {bill['events']} / {bill['completed']} |")
    print(f"| USD debited = Σ event costs | {bill['debited'] == bill['cost_sum']} "
          f"({bill['debited'] / 1e9:.9f}) |")
    print(f"| attempts per request: mean / max | "
          f"{statistics.mean(bill['attempts']):.3f} / {max(bill['attempts'])} |")
    print(f"| requests by attempts | "
          f"{', '.join(f'{k}: {v}' for k, v in sorted(attempts.items()))} |")
    print(f"| latency p50 / p99, healthy fleet | {b50 * 1000:.1f} ms / {b99 * 1000:.1f} ms |")
    print(f"| latency p50 / p99, faulty fleet | {p50 * 1000:.1f} ms / {p99 * 1000:.1f} ms |")
    print(f"| added latency p50 / p99 | {(p50 - b50) * 1000:+.1f} ms / "
          f"{(p99 - b99) * 1000:+.1f} ms |")


def report_affinity(conversations, turns, load_bound):
    served = [b for conv in conversations for b in conv]
    on_first = sum(b is not None and b == conv[0] for conv in conversations for b in conv)
    per_backend = Counter(b for b in served if b is not None)
    homes = Counter(max(set(conv), key=conv.count) for conv in conversations)
    mean = sum(per_backend.values()) / 3
    print(f"\n### Prefix affinity, load_bound {load_bound}: {len(conversations)} conversations "
          f"x {turns} turns, 3 backends, all conversations at once\n")
    print("| figure | value | target |\n|---|---|---|")
    print(f"| turns on their conversation's first backend | "
          f"{on_first / len(served):.1%} | >= 95 % |")
    print(f"| conversations per backend (where most of their turns went) | "
          f"{', '.join(str(v) for v in sorted(homes.values()))} | |")
    print(f"| turns per backend | {', '.join(str(v) for v in sorted(per_backend.values()))} | |")
    print(f"| load spread (max/mean) | {max(per_backend.values()) / mean:.2f} | <= 1.3 |")
    print(f"| failed turns | {served.count(None)} | 0 |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--part", choices=("all", "faults", "affinity"), default="all")
    parser.add_argument("--load-bounds", type=float, nargs="+", default=[1.25, 1.5],
                        help="the catalog's load_bound for each prefix-affinity run")
    parser.add_argument("--workdir", default=None, help="catalogs and slot files (a new "
                        "temporary directory by default)")
    args = parser.parse_args(argv)
    bench = Bench(args)
    try:
        faults = bench.faults() if args.part in ("all", "faults") else None
        affinity = {bound: bench.affinity(bound) for bound in args.load_bounds} \
            if args.part in ("all", "affinity") else {}
    finally:
        bench.close()
    print(f"gunicorn workers: {args.workers}; concurrency {args.concurrency}")
    if faults:
        report_faults(*faults)
    for bound, conversations in affinity.items():
        report_affinity(conversations, args.turns, bound)


if __name__ == "__main__":
    main()
