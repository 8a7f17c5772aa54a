#!/usr/bin/env python3
"""Time streamed chat completions one after another over one keep-alive socket.

For each stream it records:

* ``ttft``  -- request sent -> first SSE event with assistant text;
* ``gaps``  -- time between consecutive text events;
* ``total`` -- request sent -> ``data: [DONE]`` (or end of body).

Prints one JSON object (times in milliseconds): medians and p99s of TTFT and
total over streams, and p50/p99 of all gaps pooled.

    python bench/stream_probe.py --base-url http://127.0.0.1:8000/v1 \\
        --api-key KEY --streams 10 --chunks 64 --gap-ms 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpio import (
    ResponseParser,
    build_chat_request,
    chat_body,
    has_usage,
    is_content_event,
    median,
    percentile,
    split_base_url,
)


class StreamFailed(Exception):
    """A stream ended badly (status, early close, missing events)."""


def connect(base_url: str, timeout: float) -> socket.socket:
    host, port, _ = split_base_url(base_url)
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_stream(sock: socket.socket, request: bytes):
    """Send one request and time its SSE events.

    Returns ``(result_dict, keep_alive)``.
    """
    parser = ResponseParser()
    clock = time.perf_counter
    t0 = clock()
    sock.sendall(request)
    text_times, saw_done, saw_usage = [], False, False
    while not parser.done:
        data = sock.recv(65536)
        now = clock()
        if not data:
            parser.eof()
            if not parser.done:
                raise StreamFailed("connection closed mid-response")
            break
        for event in parser.feed(data):
            if event == b"[DONE]":
                saw_done = True
            elif is_content_event(event):
                text_times.append(now)
            saw_usage = saw_usage or has_usage(event)
    end = clock()
    if parser.status != 200:
        raise StreamFailed(f"HTTP {parser.status}: {bytes(parser.body)[:200]!r}")
    if not text_times:
        raise StreamFailed("no text events")
    result = {
        "ttft": (text_times[0] - t0) * 1000,
        "gaps": [(b - a) * 1000 for a, b in itertools.pairwise(text_times)],
        "total": (end - t0) * 1000,
        "events": len(text_times),
        "done": saw_done,
        "usage": saw_usage,
    }
    return result, parser.keep_alive


def probe(
    base_url: str,
    api_key: str,
    streams: int,
    chunks: int,
    gap_ms: float,
    timeout: float = 120.0,
) -> dict:
    """Run ``streams`` sequential streams and summarise them."""
    request = build_chat_request(base_url, api_key, chat_body(True, chunks, gap_ms))
    results, errors, sock = [], [], None
    for _ in range(streams):
        try:
            sock = sock or connect(base_url, timeout)
            result, keep_alive = read_stream(sock, request)
            results.append(result)
        except (OSError, StreamFailed, ValueError) as exc:
            errors.append(str(exc))
            keep_alive = False
        if not keep_alive and sock is not None:
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return summarize(results, errors, chunks)


def summarize(results, errors, chunks: int) -> dict:
    """Percentiles over streams (TTFT, total) and over pooled gaps."""
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    totals = [r["total"] for r in results]
    short = sum(1 for r in results if r["events"] != chunks)
    return {
        "streams": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "short_streams": short,
        "missing_done": sum(1 for r in results if not r["done"]),
        "missing_usage": sum(1 for r in results if not r["usage"]),
        "ttft_p50_ms": median(ttfts),
        "ttft_p99_ms": percentile(ttfts, 99),
        "gap_p50_ms": percentile(gaps, 50),
        "gap_p99_ms": percentile(gaps, 99),
        "total_p50_ms": median(totals),
        "total_p99_ms": percentile(totals, 99),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="")
    p.add_argument("--streams", type=int, default=10)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=120.0, help="socket timeout, seconds")
    args = p.parse_args(argv)
    summary = probe(
        args.base_url,
        args.api_key,
        args.streams,
        args.chunks,
        args.gap_ms,
        args.timeout,
    )
    print(json.dumps(summary))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
