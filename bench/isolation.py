#!/usr/bin/env python3
"""Isolation: does a flood of bad requests from one client slow another org's requests?

Starts its own Postgres database, the scripted fake upstream (tests/support/fake_upstream.py)
and one gunicorn master with ``--workers`` gevent workers (default 1, so the flood and the victim
share one event loop: the hard case). A victim org sends small non-stream chat requests one after
another, first alone, then while a flooder sends, each from its own threads:

- ``unknown-key``: requests with a key that does not exist (the same key over and over);
- ``huge-body``, ``huge-vision``: 16 MiB bodies of many small JSON values (the slowest kind to
  parse), with the flooder's own valid key, for a text-only model (refused from their size
  before parsing) and for a vision model (parsed and checked in full);
- ``huge-string``, ``huge-invalid``: 16 MiB bodies for the vision model of one long text (too
  long for any context window) and of many values that are not JSON at their very end;
- ``slow-body``: connections that announce a body and trickle it one byte a second (valid key).

It prints the victim's latency alone and under the flood (p50, p99, max), the ratio of the p99s,
what the flood's requests were answered, and the workers' peak memory. ``--root`` runs another
checkout's gateway (e.g. the main branch, for a before/after figure) with this harness.

Then a key that pays nothing ($0 org) attacks each way alone while another org runs a steady
load, and the victim's p50/p99 quiet and attacked are printed side by side:

- ``slow DNS image hosts``: 12 connections sending image URLs whose hosts (a new name each
  time) a name server answers only after 30 s: a tiny UDP DNS server started here
  (tests/support/dns_server.py), which the gateway is pointed at (``KILN_IMAGE_NAMESERVERS``).
  The victim sends small requests to a model whose backend is named ``localhost`` (its
  connections need a name lookup too) with an image URL on a host that resolves at once.
- ``huge bodies``: 4 connections sending 16 MiB bodies of tiny messages for the vision model
  (parsed in full, then refused), against the worker's parse budget; the victim sends 400 KB
  image requests (large bodies too: parsed in the child processes).

    .venv/bin/python bench/isolation.py [--root DIR] [--requests 1000] [--workers 1]
        [--attack-requests 300] [--no-mixed]
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import base64

import requests
import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "support")]

from dns_server import DnsServer  # noqa: E402
from fake_upstream import FakeUpstream  # noqa: E402
from gateway_proc import create_database, drop_database, free_port, make_org, migrate  # noqa: E402
from procstat import tree_rss_kb  # noqa: E402

CATALOG = """
[[models]]
id = "fake-model"
context_window = 8192
max_output_tokens = 1024
input = ["text"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{url}", model = "upstream-fake" }}]

[[models]]
id = "fake-vision"
context_window = 131072
max_output_tokens = 1024
input = ["text", "image"]
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "{url}", model = "upstream-vision" }}]

[[models]]
id = "fake-named"
context_window = 8192
max_output_tokens = 1024
input = ["text", "image"]
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "{named_url}", model = "upstream-named", server = "openai" }}]
"""
FAST_HOST, SLOW_SUFFIX, SLOW_S = "images.example.com", ".slow.example", 30
SMALL = json.dumps({"model": "fake-model", "max_tokens": 16,
                    "messages": [{"role": "user", "content": "Say hello"}]}).encode()
MiB = 1024 * 1024


def huge_body(model, size=16 * MiB - 4096):
    """A body of just under ``size`` bytes: many tiny messages (the costliest JSON to parse)."""
    one = b'{"role":"user","content":"x"},'
    count = (size - 64) // len(one)
    return (b'{"model":"' + model.encode() + b'","messages":[' + one * count
            + b'{"role":"user","content":"x"}]}')


def huge_string(model, size=16 * MiB - 4096):
    """A body of just under ``size`` bytes: one message of one long text (far past any
    context window, but a string the parser scans character by character)."""
    head = b'{"model":"' + model.encode() + b'","messages":[{"role":"user","content":"'
    return head + b"word " * ((size - len(head) - 8) // 5) + b'"}]}'


def image_request(model, url):
    """A small chat request with one image URL."""
    return json.dumps({"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def png_request(size=400_000):
    """A valid chat request of about ``size`` bytes for the vision model: one PNG, inline."""
    png = b"\x89PNG\r\n\x1a\n" + bytes(size * 3 // 4)
    return image_request("fake-vision", "data:image/png;base64," + base64.b64encode(png).decode())


def huge_invalid(model, size=16 * MiB - 4096):
    """Many tiny messages, then the body breaks off: not JSON, found at its very end."""
    return huge_body(model, size)[:-2]


class Gunicorn:
    """gunicorn serving ``gateway.wsgi:app`` from ``root`` with the shipped settings."""

    def __init__(self, root, env, workers):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env, "PYTHONPATH": str(root), "KILN_WORKERS": str(workers),
                    "KILN_BIND": f"127.0.0.1:{self.port}", "KILN_LOG_REQUESTS": "false",
                    "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="kiln-iso-")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(root / "deploy" / "gunicorn.conf.py"),
             "gateway.wsgi:app"], cwd=root, env=self.env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self._wait_healthy()

    def _wait_healthy(self):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/healthz", timeout=1).ok:
                    return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("gunicorn did not become healthy")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def victim(url, key, count, budget_s, body=SMALL):
    """Send ``count`` requests of ``body`` one after another (fewer if ``budget_s`` runs out);
    return their latencies (seconds) and statuses."""
    session, latencies, statuses = requests.Session(), [], collections.Counter()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    deadline = time.monotonic() + budget_s
    while len(latencies) < count and time.monotonic() < deadline:
        start = time.perf_counter()
        r = session.post(url + "/v1/chat/completions", data=body, headers=headers, timeout=60)
        latencies.append(time.perf_counter() - start)
        statuses[r.status_code] += 1
    return latencies, statuses


class Flood:
    """Bad requests from one client, until stopped; answers counted by kind.

    The flood runs in a process of its own, so that its threads do not slow the victim's
    client (the GIL): only the gateway is shared.
    """

    def __init__(self, url, key, vision=True, kinds=None):
        """:param kinds: ``{sender name: threads}`` (:class:`Senders`); None: the mixed flood."""
        self.stop_event = multiprocessing.Event()
        self._results = multiprocessing.Queue()
        self._process = multiprocessing.Process(
            target=_flood_main, args=(url, key, self.stop_event, self._results, vision, kinds),
            daemon=True)
        self.answers = {}

    def __enter__(self):
        self._process.start()
        time.sleep(1.0)  # the flood is under way before the victim measures
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.answers = self._results.get(timeout=120)
        self._process.join(30)


def _flood_main(url, key, stop_event, results, vision, chosen=None, unknown=4, slow=20):
    # A real flood's clients run on other machines: here they share the gateway's cores, so
    # they yield them (building and sending 16 MiB bodies is most of this machine's work).
    os.nice(19)
    senders = Senders(url, key, stop_event)
    huge = [senders.huge_body, senders.huge_vision, senders.huge_string, senders.huge_invalid] \
        if vision else [senders.huge_body] * 4
    kinds = [senders.unknown_key] * unknown + huge + [senders.slow_body] * slow
    if chosen is not None:
        kinds = [getattr(senders, name) for name, n in chosen.items() for _ in range(n)]
    threads = [threading.Thread(target=senders.loop, args=(k,), daemon=True) for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(dict(sorted(senders.answers.items())))


class Senders:
    """The flood's three kinds of bad request, each sent in a loop until ``stop_event``."""

    def __init__(self, url, key, stop_event):
        self.url, self.key, self.stop_event = url, key, stop_event
        self.answers = collections.Counter()
        self._lock = threading.Lock()
        self._huge = huge_body("fake-model")
        self._huge_vision = huge_body("fake-vision")
        self._huge_string = huge_string("fake-vision")
        self._huge_invalid = huge_invalid("fake-vision")

    def loop(self, send):
        session = requests.Session()
        while not self.stop_event.is_set():
            try:
                answer = send(session)
            except (requests.RequestException, OSError) as err:
                answer = type(err).__name__
            with self._lock:
                self.answers[f"{send.__name__}: {answer}"] += 1

    def _post(self, session, data, key):
        r = session.post(self.url + "/v1/chat/completions", data=data, timeout=60,
                         headers={"Authorization": f"Bearer {key}",
                                  "Content-Type": "application/json"})
        return r.status_code

    def slow_dns_image(self, session):
        """An image URL whose host (new each time) the name server answers after 30 s."""
        host = f"{uuid.uuid4().hex}{SLOW_SUFFIX}"
        return self._post(session, image_request("fake-named", f"https://{host}/a.png"),
                          self.key)

    def unknown_key(self, session):
        return self._post(session, SMALL, "kiln-unknownkeyunknownkeyunknownkey000000000000")

    def huge_body(self, session):
        return self._post(session, self._huge, self.key)

    def huge_vision(self, session):
        """A huge body for a model that takes images: it is parsed and checked in full."""
        return self._post(session, self._huge_vision, self.key)

    def huge_string(self, session):
        """One 16 MiB text for the vision model: it cannot fit, but only a parse finds so."""
        return self._post(session, self._huge_string, self.key)

    def huge_invalid(self, session):
        """16 MiB of many values that break off at the end: not JSON."""
        return self._post(session, self._huge_invalid, self.key)

    def slow_body(self, _session):
        """Announce 1,000 bytes and send one a second; return how the server ended it."""
        host, port = self.url.rsplit("/", 1)[-1].split(":")
        with socket.create_connection((host, int(port)), timeout=120) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n"
                         b"Authorization: Bearer " + self.key.encode() + b"\r\n\r\n")
            for _ in range(1000):
                if self.stop_event.wait(1.0):
                    return "stopped"
                try:
                    sock.sendall(b" ")
                except OSError:
                    return "closed"
            return sock.recv(64).split(b"\r\n")[0].decode(errors="replace") or "closed"


def summary(latencies):
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000, 1),
            "p99_ms": round(p99 * 1000, 1), "max_ms": round(ordered[-1] * 1000, 1)}


class RssSampler(threading.Thread):
    """Peak summed RSS of a process tree, sampled every 50 ms."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak_kb, self.stop_event = pid, 0, threading.Event()

    def run(self):
        while not self.stop_event.wait(0.05):
            self.peak_kb = max(self.peak_kb, tree_rss_kb([self.pid]))


ATTACKS = (  # (name, the victim's load, its body, the $0 key's senders)
    ("slow DNS image hosts", "small requests, an image URL on a host that resolves at once, "
     "backend named localhost", lambda: image_request("fake-named", f"https://{FAST_HOST}/a.png"),
     {"slow_dns_image": 12}),
    ("huge bodies", "400 KB image requests", png_request, {"huge_vision": 4}),
)


def measure_attacks(args, gw, org, free_key):
    """Each attack alone: the victim quiet, then while the $0 key attacks; return the rows."""
    rows = []
    for name, load, make_body, kinds in ATTACKS:
        body = make_body()
        quiet, _ = victim(gw.url, org.key, args.attack_requests, args.budget, body)
        with Flood(gw.url, free_key, kinds=kinds) as flood:
            attacked, statuses = victim(gw.url, org.key, args.attack_requests, args.budget, body)
        rows.append({"attack": name, "load": load, "quiet": summary(quiet),
                     "attacked": summary(attacked), "victim_statuses": dict(statuses),
                     "attack_answers": flood.answers})
    return rows


def print_attacks(rows):
    print("\n| attack by a $0 key | victim's load | requests | quiet p50 ms | quiet p99 ms "
          "| attacked p50 ms | attacked p99 ms | p99 ratio | victim answers |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for row in rows:
        quiet, attacked = row["quiet"], row["attacked"]
        ratio = attacked["p99_ms"] / quiet["p99_ms"]
        worst = max(worst, ratio)
        print(f"| {row['attack']} | {row['load']} | {attacked['n']} | {quiet['p50_ms']} | "
              f"{quiet['p99_ms']} | {attacked['p50_ms']} | {attacked['p99_ms']} | "
              f"{ratio:.2f}x | {row['victim_statuses']} |")
    for row in rows:
        print(f"{row['attack']}: the $0 key's answers {row['attack_answers']}")
    return worst


def measure(args, gw, org, flooder):
    baseline, _ = victim(gw.url, org.key, args.requests, args.budget)
    base_rss = tree_rss_kb([gw.proc.pid])
    sampler = RssSampler(gw.proc.pid)
    sampler.start()
    with Flood(gw.url, flooder.key, args.vision) as flood:
        loaded, statuses = victim(gw.url, org.key, args.requests, args.budget)
    sampler.stop_event.set()
    return {"alone": summary(baseline), "flood": summary(loaded),
            "victim_statuses": dict(statuses), "flood_answers": flood.answers,
            "rss_mib": {"before": round(base_rss / 1024), "peak": round(sampler.peak_kb / 1024)}}


def print_table(result):
    alone, flood = result["alone"], result["flood"]
    ratio = flood["p99_ms"] / alone["p99_ms"]
    print("| victim | requests | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for name, row in (("alone", alone), ("under the flood", flood)):
        print(f"| {name} | {row['n']} | {row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} |")
    print(f"\np99 ratio (flood / alone): {ratio:.2f}x")
    print(f"victim answers: {result['victim_statuses']}")
    print(f"flood answers: {result['flood_answers']}")
    print(f"workers' RSS: {result['rss_mib']['before']} MiB before, "
          f"{result['rss_mib']['peak']} MiB peak under the flood")
    return ratio


def run(args):
    name = f"kiln_isolation_{uuid.uuid4().hex[:8]}"
    url = create_database(name)
    migrate(url)
    engine = sa.create_engine(url)
    try:
        with FakeUpstream() as fake, tempfile.TemporaryDirectory() as tmp, \
                DnsServer({FAST_HOST: ["93.184.216.34"]}, slow={SLOW_SUFFIX: SLOW_S}) as dns:
            catalog = Path(tmp) / "models.toml"
            catalog.write_text(CATALOG.format(
                url=fake.base_url, named_url=fake.base_url.replace("127.0.0.1", "localhost")))
            gw = Gunicorn(args.root, {"KILN_DATABASE_URL": url, "KILN_MODELS": str(catalog),
                                      "KILN_BODY_TIMEOUT_S": str(args.body_timeout),
                                      "KILN_IMAGE_NAMESERVERS": dns.nameserver},
                          args.workers)
            try:
                org = make_org(engine, "victim", usd="1000")
                result = measure(args, gw, org, make_org(
                    engine, "flooder", usd="1000", limit=1000)) if args.mixed else None
                free = make_org(engine, "pays-nothing", usd="0", limit=1000)
                return result, measure_attacks(args, gw, org, free.key)
            finally:
                gw.stop()
    finally:
        engine.dispose()
        drop_database(name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=HERE.parent,
                        help="checkout whose gateway runs (default: this one)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--budget", type=float, default=90.0,
                        help="seconds each victim phase may take at most (default 90)")
    parser.add_argument("--body-timeout", type=float, default=10.0,
                        help="KILN_BODY_TIMEOUT_S for the run (default 10)")
    parser.add_argument("--vision", action=argparse.BooleanOptionalAction, default=True,
                        help="three of the four huge-body senders target the vision model "
                             "(default); --no-vision: all four target the text-only model")
    parser.add_argument("--attack-requests", type=int, default=300,
                        help="victim requests quiet and under each $0 key's attack (300)")
    parser.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                        help="run the mixed flood first (default); --no-mixed: only the "
                             "$0 key's attacks")
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = parser.parse_args(argv)
    result, attacks = run(args)
    ratio = print_table(result) if result is not None else 0.0
    ratio = max(ratio, print_attacks(attacks))
    if args.json:
        print(json.dumps({"mixed": result, "attacks": attacks}))
    return 0 if ratio <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
