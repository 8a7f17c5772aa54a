#!/usr/bin/env python3
"""Embeddings through Kiln against the same backend called directly: requests/s and latency
percentiles of ``POST /v1/embeddings`` both ways, and Kiln's added p50 next to chat's (a
one-token chat completion through Kiln against direct), the issue's goal being embeddings'
added p50 within 1.2x of chat's.

    python bench/embeddings.py --kiln http://127.0.0.1:8000/v1 --key KEY \\
        --direct http://127.0.0.1:8082/v1 --model smollm2-embed --backend-model smollm2-135m \\
        [--chat-model smollm2-135m --chat-direct http://127.0.0.1:8081/v1] \\
        [--requests 200 --concurrency 4 --inputs 4]

Prints one JSON object (milliseconds, requests/s). Each request is billed by Kiln: run it on a
demo org.
"""
import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else None


def drive(url, body, headers, count, concurrency):
    """POST ``body`` to ``url`` ``count`` times on ``concurrency`` sessions; return stats."""
    sessions = [requests.Session() for _ in range(concurrency)]

    def one(i):
        t0 = time.perf_counter()
        r = sessions[i % concurrency].post(url, json=body, headers=headers, timeout=120)
        r.raise_for_status()
        return time.perf_counter() - t0
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, range(count)))
    elapsed = time.perf_counter() - start
    ms = [x * 1000 for x in latencies]
    return {"requests_per_s": round(count / elapsed, 1), "p50_ms": round(percentile(ms, 50), 2),
            "p99_ms": round(percentile(ms, 99), 2)}


def run(args):
    headers = {"Authorization": f"Bearer {args.key}"}
    inputs = [f"benchmark input number {i} about gateways" for i in range(args.inputs)]
    out = {"embeddings": {
        "kiln": drive(args.kiln + "/embeddings", {"model": args.model, "input": inputs},
                      headers, args.requests, args.concurrency),
        "direct": drive(args.direct + "/embeddings",
                        {"model": args.backend_model, "input": inputs}, {}, args.requests,
                        args.concurrency)}}
    out["embeddings"]["added_p50_ms"] = round(out["embeddings"]["kiln"]["p50_ms"]
                                              - out["embeddings"]["direct"]["p50_ms"], 2)
    if args.chat_model and args.chat_direct:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        out["chat"] = {
            "kiln": drive(args.kiln + "/chat/completions", {"model": args.chat_model, **chat},
                          headers, args.requests, args.concurrency),
            "direct": drive(args.chat_direct + "/chat/completions",
                            {"model": args.backend_model, **chat}, {}, args.requests,
                            args.concurrency)}
        out["chat"]["added_p50_ms"] = round(out["chat"]["kiln"]["p50_ms"]
                                            - out["chat"]["direct"]["p50_ms"], 2)
        if out["chat"]["added_p50_ms"] > 0:
            out["embeddings_added_over_chat_added"] = round(
                out["embeddings"]["added_p50_ms"] / out["chat"]["added_p50_ms"], 2)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True, help="Kiln's base URL, ending in /v1")
    parser.add_argument("--key", required=True)
    parser.add_argument("--direct", required=True, help="the embeddings backend's base URL")
    parser.add_argument("--model", required=True, help="the catalog id")
    parser.add_argument("--backend-model", required=True, help="the backend's model name")
    parser.add_argument("--chat-model")
    parser.add_argument("--chat-direct")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--inputs", type=int, default=4)
    print(json.dumps(run(parser.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
