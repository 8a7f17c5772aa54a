#!/usr/bin/env python3
"""Hold K slow chat streams open at once against a target and sample its cost.

Opens ``--streams`` concurrent streamed chat completions (at most
``--connect-window`` waiting for their first event at a time), each paced at
``--gap-ms`` and long enough to outlive the ramp plus the hold.  Once every
stream has produced its first event (or ``--ramp-s`` ran out) it holds them for
``--hold-s`` seconds, sampling every second:

* summed VmRSS of ``--pids`` and all their descendants (the gateway's master
  and workers);
* Postgres backends on ``--pg-db`` (via ``psql --pg-dsn``), total and not idle.

Then it closes every stream (as clients that go away would) and, given
``--upstream-url`` of bench/fake_openai.py, waits until the upstream sees no
stream left, to report how fast the target stops abandoned upstream streams.
Prints one JSON object.

    python bench/open_streams.py --base-url http://127.0.0.1:8000/v1 \\
        --api-key KEY --streams 1000 --pids 1234 --pg-db kiln_bench
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import resource
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpio import (
    ResponseParser,
    build_chat_request,
    chat_body,
    is_content_event,
    median,
    percentile,
    split_base_url,
)
from procstat import pg_connections, process_tree, tree_rss_kb


def raise_nofile(wanted: int) -> int:
    """Raise the soft open-files limit towards ``wanted``; return the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


class Tally:
    """Shared counters for all streams."""

    def __init__(self):
        self.open_now = 0
        self.peak_open = 0
        self.first_event = []  # seconds from request to first text event
        self.completed = 0  # ended normally (only if the hold outlasted the stream)
        self.settled = 0  # streams that opened, or failed before opening
        self.errors = collections.Counter()
        self.error_samples = []
        self.writers = set()  # open client connections
        self.closing = False  # set when we hang up on purpose

    def opened(self, seconds: float):
        self.first_event.append(seconds)
        self.settled += 1
        self.open_now += 1
        self.peak_open = max(self.peak_open, self.open_now)

    def fail(self, kind: str, detail: str):
        if self.closing:
            return  # our own hang-up, not the target's fault
        self.errors[kind] += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(f"{kind}: {detail}"[:300])

    def hang_up(self):
        """Drop every client connection at once."""
        self.closing = True
        for writer in list(self.writers):
            writer.transport.abort()


async def read_stream(reader, parser, on_first_event) -> bool:
    """Read SSE events until the body ends; return whether ``[DONE]`` came."""
    saw_done, opened = False, False
    while not parser.done:
        data = await reader.read(65536)
        if not data:
            parser.eof()
            break
        for event in parser.feed(data):
            if not opened and is_content_event(event):
                opened = True
                on_first_event()
            saw_done = saw_done or event == b"[DONE]"
    return saw_done


async def one_stream(host, port, request, window, tally, first_seen, deadline):
    """Run one stream until it ends or we hang up, reporting to ``tally``."""
    parser, state, writer = ResponseParser(), {"open": False}, None
    await window.acquire()
    if tally.closing:  # the hold is over before this one got its turn
        window.release()
        return
    t0 = time.monotonic()

    def on_first_event():
        state["open"] = True
        tally.opened(time.monotonic() - t0)
        first_seen.set()
        window.release()

    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            try:
                async with asyncio.timeout(30):
                    reader, writer = await asyncio.open_connection(host, port)
            except (TimeoutError, OSError) as exc:
                tally.fail("connect", repr(exc))
                return
            tally.writers.add(writer)
            writer.write(request)
            saw_done = await read_stream(reader, parser, on_first_event)
        if parser.status != 200:
            tally.fail(f"http_{parser.status}", bytes(parser.body)[:200].decode("latin-1"))
        elif not parser.done or not saw_done:
            tally.fail("closed_early", f"done={parser.done} saw_done={saw_done}")
        else:
            tally.completed += 1
    except TimeoutError:
        tally.fail("timeout", f"status={parser.status} open={state['open']}")
    except (OSError, ValueError) as exc:
        tally.fail("io", repr(exc))
    finally:
        if state["open"]:
            tally.open_now -= 1
        else:
            tally.settled += 1
            window.release()
        first_seen.set()
        if writer is not None:
            tally.writers.discard(writer)
            writer.close()


class Sampler:
    """Samples gateway RSS and Postgres connections."""

    def __init__(self, pids, pg_dsn, pg_db):
        self.pids, self.pg_dsn, self.pg_db = pids, pg_dsn, pg_db
        self.rss, self.pg_total, self.pg_busy = [], [], []

    def sample(self):
        if self.pids:
            self.rss.append(tree_rss_kb(self.pids))
        if self.pg_db:
            counts = pg_connections(self.pg_dsn, self.pg_db)
            if counts:
                self.pg_total.append(counts[0])
                self.pg_busy.append(counts[1])

    async def run_for(self, seconds: float):
        end = time.monotonic() + seconds
        while True:
            await asyncio.to_thread(self.sample)
            if time.monotonic() >= end:
                return
            await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))


async def wait_until_open(tally, total, first_seen, ramp_s):
    """Wait until every stream is open or finished, or ``ramp_s`` passes."""
    end = time.monotonic() + ramp_s
    while time.monotonic() < end:
        first_seen.clear()
        if tally.settled >= total:
            return
        try:
            await asyncio.wait_for(first_seen.wait(), timeout=max(0.05, end - time.monotonic()))
        except TimeoutError:
            return


async def hold_streams(args) -> dict:
    """Open, hold, sample and drain; return the report."""
    host, port, _ = split_base_url(args.base_url)
    stream_s = args.ramp_s + args.hold_s + 10
    chunks = max(2, math.ceil(stream_s * 1000 / args.gap_ms))
    request = build_chat_request(args.base_url, args.api_key, chat_body(True, chunks, args.gap_ms))
    sampler = Sampler(args.pids, args.pg_dsn, args.pg_db)
    tree_before = set(process_tree(args.pids)) if args.pids else set()
    sampler.sample()
    base_rss = sampler.rss[-1] if sampler.rss else None
    base_pg = sampler.pg_total[-1] if sampler.pg_total else None
    sampler.rss, sampler.pg_total, sampler.pg_busy = [], [], []

    tally, window, first_seen = (
        Tally(),
        asyncio.Semaphore(args.connect_window),
        asyncio.Event(),
    )
    deadline = time.monotonic() + stream_s + 60
    t0 = time.monotonic()
    tasks = [
        asyncio.ensure_future(one_stream(host, port, request, window, tally, first_seen, deadline))
        for _ in range(args.streams)
    ]
    await wait_until_open(tally, args.streams, first_seen, args.ramp_s)
    open_s = time.monotonic() - t0
    open_at_hold = tally.open_now
    await sampler.run_for(args.hold_s)
    held_to_end = tally.open_now
    tally.hang_up()
    _, late = await asyncio.wait(tasks, timeout=10)
    for task in late:  # still connecting or queued: give up on them
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    drain = await upstream_drain(args.upstream_url, args.drain_timeout_s)
    result = report(
        args,
        tally,
        sampler,
        open_s,
        open_at_hold,
        base_rss,
        base_pg,
        time.monotonic() - t0,
    )
    # A PID of the target's process tree that vanished means a worker died or was recycled.
    lost = len(tree_before - set(process_tree(args.pids))) if args.pids else None
    result.update(held_to_end=held_to_end, processes_lost=lost, **drain)
    return result


def upstream_active(upstream_url: str):
    """``active_streams`` of the fake upstream, or ``None``."""
    url = upstream_url.rstrip("/").removesuffix("/v1") + "/bench/stats"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())["active_streams"]
    except (OSError, ValueError, KeyError):
        return None


async def upstream_drain(upstream_url: str, timeout_s: float) -> dict:
    """Seconds until the upstream has no active stream after clients left."""
    if not upstream_url:
        return {}
    start = time.monotonic()
    active = None
    while time.monotonic() - start < timeout_s:
        active = await asyncio.to_thread(upstream_active, upstream_url)
        if active == 0:
            return {
                "upstream_drain_s": round(time.monotonic() - start, 2),
                "upstream_active_left": 0,
            }
        await asyncio.sleep(0.2)
    return {"upstream_drain_s": None, "upstream_active_left": active}


def report(args, tally, sampler, open_s, open_at_hold, base_rss, base_pg, wall_s) -> dict:
    peak_rss = max(sampler.rss) if sampler.rss else None
    per_stream = None
    if peak_rss is not None and base_rss is not None and open_at_hold and peak_rss >= base_rss:
        per_stream = (peak_rss - base_rss) / open_at_hold
    return {
        "streams": args.streams,
        "open_at_hold": open_at_hold,
        "peak_open": tally.peak_open,
        "completed": tally.completed,
        "errors": sum(tally.errors.values()),
        "error_kinds": dict(tally.errors),
        "error_samples": tally.error_samples,
        "open_s": round(open_s, 2),
        "wall_s": round(wall_s, 2),
        "first_event_p50_ms": _ms(median(tally.first_event)),
        "first_event_p99_ms": _ms(percentile(tally.first_event, 99)),
        "rss_base_kb": base_rss,
        "rss_peak_kb": peak_rss,
        "rss_per_stream_kb": round(per_stream, 1) if per_stream is not None else None,
        "pg_base": base_pg,
        "pg_peak": max(sampler.pg_total) if sampler.pg_total else None,
        "pg_busy_peak": max(sampler.pg_busy) if sampler.pg_busy else None,
    }


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", default="")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--gap-ms", type=float, default=5000.0, help="pause between chunks")
    p.add_argument("--ramp-s", type=float, default=30.0, help="time allowed to open all")
    p.add_argument("--hold-s", type=float, default=10.0, help="time held together")
    p.add_argument(
        "--connect-window",
        type=int,
        default=200,
        help="streams allowed to wait for their first event at once",
    )
    p.add_argument(
        "--pids",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="comma-separated PIDs whose process trees to sample",
    )
    p.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--pg-db", default="", help="database whose backends to count")
    p.add_argument(
        "--upstream-url",
        default="",
        help="fake upstream base URL, to time how fast streams stop there",
    )
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    raise_nofile(args.streams + 1024)
    result = asyncio.run(hold_streams(args))
    print(json.dumps(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
