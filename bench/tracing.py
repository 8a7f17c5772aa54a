#!/usr/bin/env python3
"""Benchmark: what traces cost (docs/TRACES.md): Kiln's throughput with tracing on, exporting
every span over OTLP/HTTP, beside the same Kiln with tracing off, in one run.

Four gateways on one database (metered, Postgres), in front of the fast fake upstream
(``bench/fake_openai.py``, no delay): ``off`` (no endpoint: the null handle, OpenTelemetry not
imported; twice, ``off`` and ``off, again``, whose difference is the run's own noise), ``on``
(``KILN_OTEL_ENDPOINT`` set to a sink in this process that answers every
export at once and keeps its bytes; the spans are counted after the runs, so that decoding them
takes no CPU from the gateways), with Kiln's default sampler (one trace in ten, and every failed
request: docs/TRACES.md, "Sampling"), and ``on, every request`` (the same,
``OTEL_TRACES_SAMPLER=parentbased_always_on``). wrk drives non-stream requests and short streams
in interleaved rounds; the table gives medians and each gateway's ratio to ``off`` (the goal:
at least 0.95), with the gateway's own CPU time per request (read from /proc, so that a busy
machine's other work does not count), then the spans each sink received against those the
sampled requests made.

Needs Postgres at 127.0.0.1:5432 (user postgres, trust) and ``wrk``; makes and drops its own
database. Reuses bench/metering.py's processes and wrk runner.

    python bench/tracing.py                      # 3 rounds of 8 s per cell (~2 min)
    python bench/tracing.py --rounds 1 --duration 3
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from metering import (CATALOG, MODES, ROOT, create_database, drop_database, run_wrk,
                      start_gateway, start_upstream, stop, warm_up)
from procstat import cpu_seconds, process_tree

# The gateways measured side by side: label -> the sampler's settings (None: tracing off).
# "on" is tracing as shipped (Kiln's default sampler: one trace in ten, every failed request);
# "on, every request" samples them all (the SDK's own default).
# "off, again" is a second gateway identical to "off": how far two equal gateways differ in one
# run is the harness's own noise, the band a difference must leave to mean something.
VARIANTS = {"off": None, "off, again": None, "on": {},
            "on, every request": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"}}
# The share of a variant's requests whose spans are exported (none of these requests fails).
SAMPLED_SHARE = {"on": 0.1, "on, every request": 1.0}

class Sink:
    """An OTLP/HTTP endpoint that accepts ``POST /v1/traces`` and keeps each body."""

    def __init__(self):
        self.bodies, self.lock = [], threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: as a collector does

            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with sink.lock:
                    sink.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take_spans(self):
        """The spans received since the last call (decoded now, after the load)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest)
        with self.lock:
            bodies, self.bodies = self.bodies, []
        count = 0
        for body in bodies:
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            count += sum(len(scope.spans) for rs in request.resource_spans
                         for scope in rs.scope_spans)
        return count


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    p.add_argument("--duration", type=int, default=8, help="seconds of wrk per measurement")
    p.add_argument("--connections", type=int, default=16, help="wrk connections")
    p.add_argument("--workers", type=int, default=2, help="gunicorn workers per gateway")
    p.add_argument("--chunks", type=int, default=16, help="content chunks per stream")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    name = f"kiln_bench_tracing_{os.getpid()}"
    upstream, upstream_url = start_upstream(args.chunks)
    sinks = {label: Sink() for label, sampler in VARIANTS.items() if sampler is not None}
    gateways = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        models = Path(tmp) / "models.toml"
        models.write_text(CATALOG.format(url=upstream_url))
        try:
            db_url, key = create_database(name)
            for label, sampler in VARIANTS.items():
                env = {"KILN_DATABASE_URL": db_url, "KILN_MODELS": str(models),
                       "KILN_OTEL_ENDPOINT": sinks[label].endpoint if label in sinks else "",
                       **(sampler or {})}
                gateways[label] = start_gateway(env, args.workers)
            warm_up(db_url, [url for _proc, url in gateways.values()], key)
            for sink in sinks.values():
                sink.take_spans()  # the warm-up's spans are not counted
            cells = measure(args, gateways, key)
        finally:
            for proc, _url in gateways.values():
                stop(proc)  # a worker's exit exports the spans it still holds
            stop(upstream)
            drop_database(name)
    print(report(args, cells, {label: sink.take_spans() for label, sink in sinks.items()}))


def measure(args, gateways, key):
    """Run every (mode, variant) cell ``args.rounds`` times, interleaved (the variants' order
    reversed every other round); return ``{(mode, variant): [wrk result, ...]}``."""
    cells = {}
    for round_ in range(args.rounds):
        for mode, body in MODES.items():
            for label in list(VARIANTS)[::1 if round_ % 2 == 0 else -1]:
                proc, url = gateways[label]
                workers = process_tree([proc.pid])
                cpu_before = cpu_seconds(workers)
                result = run_wrk(url, key, body, args.duration, args.connections)
                served = result["rps"] * args.duration  # wrk reports a rate, not a count
                result["cpu_us"] = (cpu_seconds(workers) - cpu_before) / max(served, 1) * 1e6
                cells.setdefault((mode, label), []).append(result)
                print(f"  {mode:<10} tracing {label:<18} {result['rps']:8.1f} req/s  "
                      f"p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms  "
                      f"gateway CPU {result['cpu_us']:6.0f} us/request  "
                      f"errors {result['errors']}", file=sys.stderr, flush=True)
    return cells


# Spans of one traced request: server, admission, backend try, settlement; a stream's also.
SPANS_PER_REQUEST = {"non-stream": 4, "stream": 5}


def report(args, cells, spans_received):
    """Return the side-by-side table (medians over the rounds) and, per traced gateway, the
    spans received (``{label: count}``) against those its requests made."""
    lines = [f"Kiln with tracing on (spans exported over OTLP/HTTP) vs off: wrk "
             f"-c{args.connections}, {args.duration} s x {args.rounds} interleaved rounds, "
             f"{args.workers} gevent workers, metered on Postgres, medians",
             "",
             f"{'mode':<11}{'tracing':<19}{'req/s':>8}{'vs off':>8}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'errors':>7}{'CPU us/req':>12}{'vs off':>8}"]
    for mode in MODES:
        off = {k: statistics.median(r[k] for r in cells[(mode, "off")]) for k in ("rps", "cpu_us")}
        for label in VARIANTS:
            runs = cells[(mode, label)]
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
            lines.append(f"{mode:<11}{label:<19}{med['rps']:>8.1f}{med['rps'] / off['rps']:>8.2f}"
                         f"{med['p50_ms']:>9.2f}{med['p99_ms']:>9.2f}"
                         f"{sum(r['errors'] for r in runs):>7}{med['cpu_us']:>12.0f}"
                         f"{med['cpu_us'] / off['cpu_us']:>8.2f}")
    lines += ["", "CPU us/req: the gateway's processes' CPU time (user + system, all workers) over "
              "the requests served: what a request costs, whatever else the machine runs.", ""]
    for label, received in spans_received.items():
        # wrk reports a rate, not a count: the requests are about rate x duration.
        made = SAMPLED_SHARE[label] * sum(
            r["rps"] * args.duration * SPANS_PER_REQUEST[mode]
            for (mode, variant), runs in cells.items() if variant == label for r in runs)
        lines.append(f"Spans received from '{label}': {received} for about {made:.0f} spans of "
                     f"its sampled requests ({received / max(made, 1):.2f}).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
