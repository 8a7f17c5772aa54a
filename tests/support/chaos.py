"""Seeded chaos run of Kiln: two gateway hosts on one private Postgres, fake backends with
fault modes, seeded random clients, and system faults, checked against Kiln's invariants.

    python tests/support/chaos.py --seed N --duration S        (or: make chaos SEED=N DURATION=S)

The schedule (client actions and faults) is drawn from the seed before the run starts
(``chaos_plan``); the run prints a figures table (requests by kind and outcome, faults by kind,
violations by invariant) and exits 1 on any violation, 2 if the harness itself failed.
docs/RELIABILITY.md describes what is checked and how to read the table.
"""
import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg

import chaos_checks as checks
from chaos_clients import Keys, play, play_burst
from chaos_cluster import (GATEWAY_SETTINGS, Database, Gateways, Kiln, PrivatePostgres,
                           catalog_toml)
from chaos_plan import ORGS, build_plan, fingerprint
from chaos_report import CREDITS_SQL, print_evidence, print_report
from chaos_upstream import Backends, parse_marker

LEASE_TTL_S = float(GATEWAY_SETTINGS["KILN_LEASE_TTL_S"])
# How long after a revocation or `maintenance on` every worker must follow: the key cache TTL
# or the maintenance poll interval, plus a margin wide enough for a loaded machine.
KEY_GRACE_S = float(GATEWAY_SETTINGS["KILN_KEY_CACHE_TTL_S"]) + 2.0
MAINTENANCE_GRACE_S = float(GATEWAY_SETTINGS["KILN_MAINTENANCE_POLL_S"]) + 2.0
SAMPLE_EVERY_S = 1.0


@dataclass
class FaultRecord:
    """One executed system fault: ``result`` is "done", "refused" or "failed"."""

    kind: str
    t_planned: float
    t_start: float
    t_end: float
    result: str
    state: str = ""
    detail: str = ""
    gateway: int = None  # the host a worker_kill or a HUP was applied to


class ChaosRun:
    """One run of a plan: set up, play the schedule, quiesce, check, report."""

    def __init__(self, plan, workdir):
        self.plan = plan
        self.workdir = Path(workdir)
        self.violations = checks.Violations()
        self.observations = []
        self.fault_log = []
        self.peaks = {}
        self.samples = Counter()
        self.backend_peaks = {}
        self.notes = []
        self._obs_lock = threading.Lock()
        self._stop = threading.Event()

    # -- set-up ------------------------------------------------------------------------------

    def setup(self):
        # Each part is kept before it starts, so that teardown stops it even if its start fails.
        self.pg = PrivatePostgres(self.workdir)
        self.pg.start()
        self.db = Database(self.pg.dsn)
        self.backends = Backends(self.plan)
        self.backends.__enter__()
        urls = [f.base_url for f in self.backends.fakes]
        catalog = self.workdir / "models.toml"
        catalog.write_text(catalog_toml(urls[-1], urls[:-1]))
        env = {"KILN_DATABASE_URL": self.pg.url, "KILN_MODELS": str(catalog)}
        self.kiln = Kiln(env)
        self.kiln("db", "upgrade")
        self.org_ids, self.org_names, keys = {}, {}, {}
        for i, (limit, usd) in enumerate(ORGS):
            name = f"chaos-org-{i}"
            self.org_ids[i] = int(self.kiln("org", "create", name, "--limit", str(limit))
                                  .stdout.split()[-1])
            self.org_names[i] = name
            keys[i] = self.kiln("key", "create", name).stdout.strip().splitlines()[-1]
            self._grant(i, usd, "chaos: starting credits")
        self.keys = Keys(keys)
        self.gateways = Gateways(env, self.workdir)
        self.gateways.start()

    def _grant(self, org, usd, note):
        # The README's top-up: one plain INSERT; the trigger moves the balance.
        self.db.query("INSERT INTO credit_grants (org_id, amount_usd, note) "
                      "VALUES (%s, CAST(%s AS NUMERIC(20, 9)), %s)",
                      (self.org_ids[org], usd, note))

    def teardown(self):
        for name in ("gateways", "backends"):
            part = getattr(self, name, None)
            if part is not None:
                try:
                    part.stop() if name == "gateways" else part.__exit__(None, None, None)
                except Exception as err:  # noqa: BLE001 - tear down the rest regardless
                    self.notes.append(f"stopping {name}: {err}")
        if getattr(self, "db", None):
            self.db.close()
        if getattr(self, "pg", None):
            self.pg.stop()

    # -- the run -----------------------------------------------------------------------------

    def play(self):
        self.t0 = time.monotonic()
        sampler = threading.Thread(target=self._sample_forever, daemon=True)
        injector = threading.Thread(target=self._inject_faults, daemon=True)
        sampler.start()
        injector.start()
        with ThreadPoolExecutor(max_workers=96) as pool:
            futures = []
            for action in self.plan.actions:
                self._sleep_until(action.t_s)
                futures.append(pool.submit(self._play_action, action))
            for future in futures:
                future.result()
        injector.join()
        self.traffic_end = time.monotonic()
        self.gateways_alive = self.gateways.alive()
        self._quiesce()
        self._stop.set()
        sampler.join()

    def _sleep_until(self, t_s):
        delay = self.t0 + t_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _play_action(self, action):
        port = self.gateways.port(action.gateway)
        if action.kind == "burst":
            seen = play_burst(port, action, self.keys)
        else:
            key_kind = "revoked" if action.kind == "stale_key" else "current"
            seen = [play(port, action, 0, self.keys, key_kind)]
        for o in seen:
            o.gateway = action.gateway
        with self._obs_lock:
            self.observations.extend(seen)

    def _sample_forever(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(SAMPLE_EVERY_S)

    def _sample(self):
        try:
            rows = self.db.query(checks.BALANCES_SQL)
        except psycopg.Error:
            self.samples["skipped (database unreachable)"] += 1
            return
        self.samples["taken"] += 1
        checks.check_balances(rows, self.violations, self.peaks, time.monotonic(), self.t0)

    # -- faults ------------------------------------------------------------------------------

    def _inject_faults(self):
        for fault in self.plan.faults:
            self._sleep_until(fault.t_s)
            start = time.monotonic()
            try:
                result, detail = self._fault(fault)
            except Exception as err:  # noqa: BLE001 - a fault that could not be applied
                result, detail = "failed", f"{type(err).__name__}: {err}"
            self.fault_log.append(FaultRecord(fault.kind, fault.t_s, start, time.monotonic(),
                                              result, fault.state, detail, fault.gateway))

    def _fault(self, fault):
        if fault.kind == "worker_kill":
            pid = self.gateways.kill_worker(fault.gateway, fault.worker)
            return ("done", f"host {fault.gateway} pid {pid}") if pid else ("failed", "no worker")
        if fault.kind == "hup":
            self.gateways.reload(fault.gateway)
            return "done", f"host {fault.gateway}"
        if fault.kind == "pg_restart":
            self.pg.restart_immediate()
            return "done", ""
        if fault.kind in ("sql_topup", "sql_correction"):
            return self._sql_grant(fault)
        if fault.kind == "key_revoke":
            return self._revoke(fault)
        if fault.kind == "maintenance":
            args = ["maintenance", fault.state]
            if fault.state == "on":
                args += ["--retry-after", "5", "--message", "chaos maintenance"]
            self.kiln(*args)
            return "done", fault.state
        raise ValueError(f"unknown fault {fault.kind}")

    def _sql_grant(self, fault):
        deadline = time.monotonic() + 10
        while True:
            try:
                self._grant(fault.org, fault.usd, f"chaos: {fault.kind}")
                return "done", f"org {fault.org} {fault.usd} USD"
            except psycopg.errors.CheckViolation as err:
                # migration 0002: a correction may not leave the balance below the holds
                return "refused", str(err).splitlines()[0]
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def _revoke(self, fault):
        created = self.kiln("key", "create", self.org_names[fault.org])
        new_key = created.stdout.strip().splitlines()[-1]
        found = re.search(r"key prefix (\S+);", created.stderr)

        def revoke(old_key):
            # the display prefix of a key is its start (`kiln key create` prints the new one's)
            prefix = old_key[:len(found.group(1))] if found else old_key[:12]
            self.kiln("key", "revoke", prefix)
        old = self.keys.replace(fault.org, new_key, revoke)
        return "done", f"org {fault.org} revoked {old[:12]}"

    # -- quiescence and final checks -----------------------------------------------------------

    def _quiesce(self):
        """No client left; wait one lease TTL past it, sweep, and check what is left."""
        windows = checks.maintenance_windows(self.fault_log)
        if windows and windows[-1][1] == float("inf"):
            self.kiln("maintenance", "off")
            self.notes.append("maintenance was still on at the end: switched off")
        self.db.query_retrying("SELECT 1")
        time.sleep(LEASE_TTL_S + 1.0)
        sweep = self.kiln("sweep", check=False)
        self.notes.append(f"final `kiln sweep`: {sweep.stdout.strip() or sweep.stderr.strip()}")
        self._sample()
        leases = [tuple(r.values()) for r in self.db.query_retrying(checks.LEASES_SQL)]
        pending = [tuple(r.values()) for r in self.db.query_retrying(checks.PENDING_SQL)]
        checks.check_quiet(leases, pending, self.violations)

    def check(self):
        """The checks after the run: client views against the database, and reconcile."""
        gids = [o.gen_id for o in self.observations if o.gen_id]
        events = {r["id"]: r for r in self.db.query_retrying(checks.EVENTS_SQL, (gids,))}
        kills = [(f.gateway, f.t_start, f.t_end) for f in self.fault_log
                 if f.kind == "worker_kill" and f.result == "done"]
        checks.check_complete(self.observations, events, self.org_ids, self.violations, kills,
                              settle_slack_s=2 * LEASE_TTL_S)
        records = self.backends.records()
        reached = {found[:2] for found in (parse_marker(r.json) for r in records
                                           if isinstance(r.json, dict)) if found}
        checks.check_answers(self.observations, events, reached, self.violations)
        checks.check_keys(self.observations, KEY_GRACE_S, self.violations)
        windows = checks.maintenance_windows(self.fault_log)
        checks.check_maintenance(self.observations, windows, MAINTENANCE_GRACE_S,
                                 self.violations)
        checks.check_bad_requests(self.observations, self.violations)
        spans = checks.backend_intervals(records, parse_marker)
        limits = {i: limit for i, (limit, _) in enumerate(ORGS)}
        self.backend_peaks = checks.check_backend_concurrency(spans, limits, self.violations,
                                                              self.t0)
        self.credits = self.db.query_retrying(CREDITS_SQL)
        done = self.kiln("credits", "reconcile", check=False)
        self.reconcile_output = done.stdout + done.stderr
        checks.check_reconcile(done.returncode, self.reconcile_output, self.violations)
        if self.backends.errors():
            raise RuntimeError("fake backend failed:\n" + "\n".join(self.backends.errors()))

def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument("--rate", type=float, default=6.0, help="client actions per second")
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir, "
                        "removed after a clean run)")
    parser.add_argument("--print-schedule", action="store_true",
                        help="print the schedule as JSON lines and exit")
    args = parser.parse_args(argv)
    plan = build_plan(args.seed, args.duration, args.rate)
    if args.print_schedule:
        for item in plan.actions + plan.faults:
            print(json.dumps({"type": type(item).__name__, **asdict(item)}))
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed={plan.seed} duration={plan.duration_s:g}s schedule={fingerprint(plan)} "
          f"({len(plan.actions)} actions, {len(plan.faults)} faults); logs in {workdir}",
          flush=True)
    # SIGTERM (a CI timeout, systemd) stops the run like Ctrl-C: what it started is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    run = ChaosRun(plan, workdir)
    try:
        run.setup()
        run.play()
        run.check()
    except KeyboardInterrupt:
        print(f"chaos: interrupted; logs kept in {workdir}", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(f"chaos: the harness failed; logs kept in {workdir}", file=sys.stderr)
        return 2
    finally:
        run.teardown()
    print_report(run)
    print_evidence(run)
    if run.violations.total:
        print(f"chaos: {run.violations.total} violation(s); logs kept in {workdir}")
        return 1
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
