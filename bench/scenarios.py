"""What bench/run.py measures: the scenarios, which targets each runs on, and the run's sizes.

A scenario is one measurement of one target: a wrk run (non-stream requests at a fixed number
of connections), a stream probe (sequential paced streams, bench/stream_probe.py), a relay run
(a few unpaced streams at once, counted against the target's CPU time, bench/relay_probe.py)
or a burst of streams held open at once (bench/open_streams.py). Each runs only on the targets
that one of the reported comparisons needs, so that a full run stays short.

Scenarios come in blocks. Within a round, bench/run.py runs a block on every target in turn
before the next block, so that two values whose ratio is reported (Kiln metered and unmetered,
Kiln unmetered and the floor) are measured a few seconds apart, not minutes: on a shared
machine the background load drifts on that scale.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import procstat as ps
import targets as tg
from relay_probe import relay
from stream_probe import probe

BENCH_DIR = Path(__file__).resolve().parent

DIRECT, KILN, NOMETER, FLOOR, LITELLM = "direct", "kiln", "kiln-nometer", "floor", "litellm"
TARGETS = (DIRECT, KILN, NOMETER, FLOOR, LITELLM)  # the order of the table's columns
ORGS_CONNS = 64  # the many-orgs scenario: this many connections, one org (and key) each
BLOCKS = ("latency", f"c{ORGS_CONNS}", "more", "burst")  # the order a round runs them in
LITELLM_OPEN_MAX = 5000  # LiteLLM takes minutes to open more streams; its column stops here


@dataclass
class Scenario:
    """One measurement, run once per target per round (bursts: once per target)."""

    key: str
    title: str
    kind: str  # "wrk" | "dialect" | "endpoints" | "stream" | "relay" | "open"
    run: Callable[[tg.Target], dict]
    targets: frozenset  # the targets it runs on
    block: str  # scenarios whose values are compared run in one block, target after target


@dataclass
class Plan:
    """Sizes and durations for one run."""

    rounds: int = 3
    wrk_seconds: int = 10
    concurrencies: list = field(default_factory=lambda: [1, 16, 64])
    streams_20ms: int = 10
    streams_1ms: int = 50
    fast_streams: int = 4  # unpaced streams at once in the relay scenario
    fast_chunks: int = 2000  # text chunks per unpaced stream
    open_counts: list = field(default_factory=lambda: [5000, 10000])
    open_hold_s: float = 10.0
    open_gap_ms: float = 5000.0


QUICK = Plan(
    rounds=1,
    wrk_seconds=3,
    streams_20ms=3,
    streams_1ms=10,
    open_counts=[1000],
    open_hold_s=3.0,
)


def wrk_run(
    target: tg.Target, connections: int, seconds: int, org_keys=None, path="/chat/completions",
    body=None,
) -> dict:
    """Non-stream chat completions with wrk; latencies in ms.

    With ``org_keys`` every connection has its own wrk thread and its own key; ``path`` and
    ``body`` (a dict) send another request (``/responses``, ``/embeddings``...).
    """
    threads = connections if org_keys else 1 if connections == 1 else 2
    argv = [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency",
        "--timeout", "30s", "-s", str(BENCH_DIR / "chat.lua"),
        f"{target.base_url}{path}",
    ]  # fmt: skip
    env = dict(os.environ, BENCH_API_KEY=target.api_key)
    if body is not None:
        env["BENCH_BODY"] = json.dumps(body, separators=(",", ":"))
    if org_keys:
        if len(org_keys) < connections:
            raise RuntimeError(f"{target.name}: {len(org_keys)} org keys for {connections} conns")
        env["BENCH_API_KEYS"] = ",".join(org_keys[:connections])
    gateway, postgres = ps.process_tree(target.pids), ps.pids_named("postgres")
    cpu_before = ps.cpu_seconds(gateway), ps.cpu_seconds(postgres)
    out = subprocess.run(
        argv, capture_output=True, text=True, env=env, check=False, timeout=seconds + 60
    )
    cpu_after = ps.cpu_seconds(gateway), ps.cpu_seconds(ps.pids_named("postgres"))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {out.stdout[-500:]} {out.stderr[-500:]}")
    raw = json.loads(line.removeprefix("WRK_JSON "))
    errors = sum(
        raw[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts", "non2xx")
    )
    done = raw["requests"] > 0  # with no reply in time wrk reports zero latencies
    return {
        "rps": raw["rps"],
        "p50_ms": raw["p50_us"] / 1000 if done else None,
        "p99_ms": raw["p99_us"] / 1000 if done else None,
        "requests": raw["requests"],
        "errors": errors if done else max(errors, 1),
        # CPU milliseconds per request: the target's processes, and every Postgres process
        # (the server is the benchmark's own: only the target uses it during the run)
        "cpu_ms": _per_request(cpu_after[0] - cpu_before[0], raw["requests"]),
        "pg_cpu_ms": _per_request(cpu_after[1] - cpu_before[1], raw["requests"])
        if target.db_name else None,
    }


def _per_request(cpu_s: float, requests: int):
    return cpu_s * 1000 / requests if requests else None


def durable_commit_ms(db_name: str, n: int = 200) -> float:
    """The median milliseconds of a durable one-row commit (an INSERT in autocommit, which
    waits for its WAL flush) on ``db_name``: what one commit physically costs on this machine
    now, the yardstick of metering's added latency (issue 26: within 1.5 of these)."""
    import psycopg

    times = []
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{db_name}",
                         autocommit=True) as conn:
        # a logged table: a temporary one writes no WAL, and its commit waits for nothing
        conn.execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (x integer)")
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                conn.execute("INSERT INTO bench_commit_probe VALUES (1)")
                times.append(time.perf_counter() - t0)
        finally:
            conn.execute("DROP TABLE bench_commit_probe")
    return statistics.median(times) * 1000


def latency_run(target: tg.Target, seconds: int) -> dict:
    """wrk at one connection; on a metered Kiln, then the durable commit on its database."""
    out = wrk_run(target, 1, seconds)
    if target.name == KILN and target.db_name:
        out["commit_ms"] = durable_commit_ms(target.db_name)
    return out


RESPONSES_TURNS = 20  # the history a previous_response_id request carries (issue 23)


def responses_body(previous=None) -> dict:
    """A small non-stream ``POST /v1/responses`` body, as chat.lua's chat body (the answer is
    stored, OpenAI's default), continuing ``previous`` when given."""
    body = {"model": "bench-model", "max_output_tokens": 16,
            "input": "Say hello in one short sentence."}
    if previous:
        body["previous_response_id"] = previous
    return body


def responses_chain(target: tg.Target, turns: int) -> str:
    """Store a conversation of ``turns`` responses, each continuing the one before, on
    ``target``; return the last one's id."""
    import http.client

    from httpio import split_base_url

    host, port, prefix = split_base_url(target.base_url)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    previous = None
    try:
        for turn in range(turns):
            body = {**responses_body(previous),
                    "input": f"Turn {turn}: tell me one more thing about the sea, briefly."}
            conn.request("POST", f"{prefix}/responses", json.dumps(body),
                         {"Content-Type": "application/json",
                          "Authorization": f"Bearer {target.api_key}"})
            resp = conn.getresponse()
            answer = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"responses turn {turn}: {resp.status} {answer[:300]!r}")
            previous = json.loads(answer)["id"]
    finally:
        conn.close()
    return previous


COMPLETIONS_BODY = {"model": "bench-model", "max_tokens": 16,
                    "prompt": "Say hello in one short sentence."}  # chat.lua's, as a prompt
EMBEDDINGS_BODY = {"model": "bench-model", "input": "Say hello in one short sentence."}
# The endpoints beside chat: name -> (path under /v1, body; None: chat.lua's, which is also a
# Messages request). Each is one small non-stream request, as chat's.
ENDPOINTS = {
    "messages": ("/messages", None),
    "responses": ("/responses", responses_body()),
    "completions": ("/completions", COMPLETIONS_BODY),
    "embeddings": ("/embeddings", EMBEDDINGS_BODY),
}
ENDPOINTS_CONNS = 64  # the connections of the endpoints' throughput scenario


def chat_beside(target: tg.Target, seconds: int) -> dict:
    """Chat at one connection (wrk), the first half of a run beside chat: its values, also as
    ``chat_p50_ms``, ``chat_p99_ms`` and ``chat_rps``."""
    chat = wrk_run(target, 1, seconds)
    return {**chat, "chat_p50_ms": chat["p50_ms"], "chat_p99_ms": chat["p99_ms"],
            "chat_rps": chat["rps"]}


def responses_run(target: tg.Target, seconds: int, turns: int = 0) -> dict:
    """``POST /v1/responses`` at one connection (wrk), beside chat's on the same target a few
    seconds before: ``p50_ms``, ``rps``... are the Responses API's, ``chat_p50_ms``,
    ``chat_rps`` chat's. With ``turns``, each request continues a stored conversation of that
    many turns (``previous_response_id``: the chain is read and carried on every request).
    Direct (the fake upstream) has no Responses API: its values are chat's, the baseline that
    "added" subtracts."""
    out = chat_beside(target, seconds)
    if target.name == DIRECT:
        return out
    previous = responses_chain(target, turns) if turns else None
    resp = wrk_run(target, 1, seconds, path="/responses", body=responses_body(previous))
    return {**out, **resp, "errors": resp["errors"] + out["errors"]}


def messages_run(target: tg.Target, seconds: int) -> dict:
    """``POST /v1/messages`` (Anthropic's Messages API) at one connection, beside chat's on the
    same target a few seconds before, as :func:`responses_run`; the body is chat.lua's, which
    is both a chat and a Messages request. Direct's values are chat's."""
    out = chat_beside(target, seconds)
    if target.name == DIRECT:
        return out
    msg = wrk_run(target, 1, seconds, path="/messages")
    return {**out, **msg, "errors": msg["errors"] + out["errors"]}


def upstream_api_run(target: tg.Target, seconds: int, name: str) -> dict:
    """Endpoint ``name`` (``completions``, ``embeddings``: APIs the upstream serves too) at one
    connection, beside chat's on the same target a few seconds before, as :func:`messages_run`.
    Direct measures both as well, so that what a gateway adds on each is over the same API
    direct."""
    out = chat_beside(target, seconds)
    path, body = ENDPOINTS[name]
    res = wrk_run(target, 1, seconds, path=path, body=body)
    return {**out, **res, "errors": res["errors"] + out["errors"]}


def endpoints_run(target: tg.Target, seconds: int) -> dict:
    """Throughput at ``ENDPOINTS_CONNS`` connections (wrk) of every endpoint of ``ENDPOINTS``
    and of chat, one after the other on the same target, chat in the middle so that no
    endpoint runs more than two runs from it: ``<name>_rps`` and ``chat_rps`` in requests/s,
    ``errors`` summed over the runs."""
    names = list(ENDPOINTS)
    half = len(names) // 2
    out = {"errors": 0}
    for name in [*names[:half], "chat", *names[half:]]:
        path, body = ENDPOINTS.get(name, ("/chat/completions", None))
        res = wrk_run(target, ENDPOINTS_CONNS, seconds, path=path, body=body)
        out[f"{name}_rps"] = res["rps"]
        out["errors"] += res["errors"]
    return out


def orgs_run(target: tg.Target, seconds: int) -> dict:
    """wrk at ``ORGS_CONNS`` connections, each with the key of a different org."""
    if not target.org_keys:
        raise RuntimeError(f"{target.name} has no org keys")
    return wrk_run(target, ORGS_CONNS, seconds, org_keys=target.org_keys)


def stream_run(target: tg.Target, streams: int, gap_ms: float) -> dict:
    """Sequential 64-chunk streams, timed per chunk."""
    return probe(target.base_url, target.api_key, streams, 64, gap_ms)


DRAIN_TIMEOUT_S = 60
RAMP_MAX_S = 120  # streams not open by then count as failed (direct opens 10,000 in seconds)


def open_run(target: tg.Target, count: int, plan: Plan, upstream_url: str) -> dict:
    """Hold ``count`` slow streams at once via bench/open_streams.py."""
    ramp_s = min(RAMP_MAX_S, 10 + count / 50)
    argv = [
        sys.executable, str(BENCH_DIR / "open_streams.py"),
        "--base-url", target.base_url, "--api-key", target.api_key,
        "--streams", str(count), "--gap-ms", str(plan.open_gap_ms),
        "--ramp-s", str(ramp_s), "--hold-s", str(plan.open_hold_s),
        "--upstream-url", upstream_url, "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
    ]  # fmt: skip
    if target.name != DIRECT:
        argv += ["--pids", ",".join(map(str, target.pids))]
    if target.db_name:
        argv += ["--pg-db", target.db_name]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        timeout=ramp_s + plan.open_hold_s + 240,
    )
    if not out.stdout.strip():
        raise RuntimeError(f"open_streams failed: {out.stderr[-800:]}")
    time.sleep(2)  # let the target settle before it is stopped
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(plan: Plan, upstream_url: str) -> list:
    """The scenarios of ``plan``, in the order each target runs them."""
    secs = plan.wrk_seconds
    every = frozenset({DIRECT, KILN, NOMETER, FLOOR, LITELLM})
    vs_litellm = frozenset({DIRECT, KILN, LITELLM})
    scs = [
        Scenario(
            "nonstream_c1",
            "non-stream, 1 conn",
            "wrk",
            lambda t: latency_run(t, secs),
            every,
            "latency",
        ),
        Scenario(
            "messages_c1",
            "POST /v1/messages beside chat, 1 conn",
            "dialect",
            lambda t: messages_run(t, secs),
            frozenset({DIRECT, KILN}),
            "latency",
        ),
        Scenario(
            "responses_c1",
            "POST /v1/responses beside chat, 1 conn",
            "dialect",
            lambda t: responses_run(t, secs),
            frozenset({DIRECT, KILN}),
            "latency",
        ),
        Scenario(
            f"responses_prev{RESPONSES_TURNS}_c1",
            f"/v1/responses continuing a {RESPONSES_TURNS}-turn history beside chat, 1 conn",
            "dialect",
            lambda t: responses_run(t, secs, RESPONSES_TURNS),
            frozenset({DIRECT, KILN}),
            "latency",
        ),
    ]
    scs += [
        Scenario(
            f"{name}_c1",
            f"POST /v1/{name} beside chat, 1 conn",
            "dialect",
            lambda t, name=name: upstream_api_run(t, secs, name),
            frozenset({DIRECT, KILN}),
            "latency",
        )
        for name in ("completions", "embeddings")
    ]
    for c in plan.concurrencies:
        if c == 1:
            continue  # the latency scenario above is concurrency 1
        scs.append(
            Scenario(
                f"tput_c{c}",
                f"non-stream, {c} conns",
                "wrk",
                lambda t, c=c: wrk_run(t, c, secs),
                every if c == ORGS_CONNS else vs_litellm,
                f"c{ORGS_CONNS}" if c == ORGS_CONNS else "more",
            )
        )
    scs += [
        Scenario(
            f"orgs_c{ORGS_CONNS}",
            f"non-stream, {ORGS_CONNS} conns, {ORGS_CONNS} orgs (one each)",
            "wrk",
            lambda t: orgs_run(t, secs),
            frozenset({KILN, NOMETER}),
            f"c{ORGS_CONNS}",
        ),
        Scenario(
            f"endpoints_c{ENDPOINTS_CONNS}",
            f"every endpoint beside chat, {ENDPOINTS_CONNS} conns",
            "endpoints",
            lambda t: endpoints_run(t, secs),
            frozenset({KILN}),
            "more",
        ),
        Scenario(
            "stream_fast",
            f"stream {plan.fast_chunks}×0 ms, {plan.fast_streams} at once",
            "relay",
            lambda t: relay(t, plan.fast_streams, plan.fast_chunks, secs),
            frozenset({DIRECT, KILN, FLOOR, LITELLM}),
            f"c{ORGS_CONNS}",  # where the floor runs too: its ratio to Kiln is seconds apart
        ),
        Scenario(
            "stream_20ms",
            "stream 64×20 ms",
            "stream",
            lambda t: stream_run(t, plan.streams_20ms, 20),
            vs_litellm | {NOMETER},
            "more",
        ),
        Scenario(
            "stream_1ms",
            "stream 64×1 ms",
            "stream",
            lambda t: stream_run(t, plan.streams_1ms, 1),
            vs_litellm,
            "more",
        ),
    ]
    for k in plan.open_counts:
        scs.append(
            Scenario(
                f"open_{k}",
                f"{k} open streams",
                "open",
                lambda t, k=k: open_run(t, k, plan, upstream_url),
                vs_litellm if k <= LITELLM_OPEN_MAX else frozenset({DIRECT, KILN}),
                "burst",
            )
        )
    return scs
