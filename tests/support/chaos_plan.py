"""The schedule of a chaos run, drawn from its seed before anything starts.

Everything random about a run is decided here, up front, from ``random.Random(seed)``: when
each client action starts, what it sends, how it reads, which backend fault its request meets,
and when each system fault fires. The run then only follows the schedule, so the same seed
replays the same schedule (wall-clock timing around it varies: thread wake-ups, how long a
Postgres restart takes, which gunicorn worker accepts a connection). :func:`fingerprint` gives
a short hash of a schedule to compare two runs.
"""
import hashlib
import random
from dataclasses import asdict, dataclass, field

# Orgs of a run: (in-flight limit, starting credits in USD). Small limits so that bursts and
# ordinary traffic meet 429; one org close to empty so that 402 and refused corrections occur.
ORGS = ((3, "20"), (2, "3"), (4, "0.5"), (2, "0.02"))
ORG_WEIGHTS = (4, 3, 2, 1)
MODELS = ("chaos-a", "chaos-b", "chaos-meter")
MODEL_WEIGHTS = (4, 3, 2)
GATEWAYS = 2

# Client kinds (README "API"; docs/RELIABILITY.md describes each).
CLIENT_KINDS = {
    "chat": 22,          # non-stream, read whole
    "stream": 28,        # stream with stream_options.include_usage, read whole
    "disconnect": 14,    # stream or not; the client closes at a random point
    "slow_reader": 6,    # stream read a few bytes at a time through a small receive buffer
    "bad_body": 9,       # a request the contract refuses (400, 401, 404, 413)
    "burst": 3,          # limit + k concurrent slow streams of one org: some must meet 429
    "stale_key": 3,      # a revoked key of the org (403 once revoked) or an unknown key (401)
}
# What the backend does with an admitted request. Every kind but "ok" is a backend fault.
UPSTREAM_KINDS = {
    "ok": 64,
    "reset": 6,           # TCP RST mid-body
    "error_500": 5,       # HTTP 500 before any byte of the reply
    "hang": 3,            # the backend stops sending (before the status line, or mid-stream)
    "garbage": 6,         # bytes that are not HTTP, not JSON, or not SSE
    "usage_null": 4,      # usage lies: null,
    "usage_negative": 4,  # negative counts,
    "usage_string": 4,    # counts as strings, or usage itself a string,
    "usage_huge": 4,      # far above what was sent (priced at the hold at most)
}
BAD_BODIES = ("not_json", "empty_messages", "messages_not_list", "bad_stream_flag",
              "unknown_model", "no_auth", "truncated", "too_large", "negative_max_tokens",
              "wrong_content_type")
# System faults: mean seconds between two of the kind (Poisson); each kind also occurs once
# at a random time, so that a short run meets all of them.
FAULT_MEAN_GAP_S = {
    "worker_kill": 25,
    "hup": 35,
    "pg_restart": 45,
    "sql_topup": 12,
    "sql_correction": 15,
    "key_revoke": 30,
    "maintenance": 40,   # "on", then "off" 1-4 s later (two scheduled steps)
}


@dataclass(frozen=True)
class Upstream:
    """How the fake backend answers one request: ``kind`` (UPSTREAM_KINDS) and its shape."""

    kind: str = "ok"
    chunks: int = 4           # content chunks of a stream (or words of a reply)
    delay_s: float = 0.0      # between stream chunks
    pad: int = 0              # extra bytes of content per chunk (back-pressure on slow readers)
    variant: int = 0          # which form of the fault (see chaos_upstream)
    cut_after: int = 1        # chunks sent before a reset or hang mid-stream


@dataclass(frozen=True)
class Action:
    """One client action: a request (or a burst of ``size`` requests) at ``t_s`` seconds."""

    id: int
    t_s: float
    kind: str
    org: int
    gateway: int
    model: str
    stream: bool
    max_tokens: int | None
    upstream: Upstream
    size: int = 1                 # burst: concurrent requests
    filler: int = 0               # extra prompt bytes
    disconnect_at: str = ""       # "mid_send", "before_headers", "after_bytes"
    disconnect_bytes: int = 0
    disconnect_delay_s: float = 0.0
    read_bytes: int = 0           # slow reader: bytes per read
    read_pause_s: float = 0.0     # slow reader: pause between reads
    bad_body: str = ""


@dataclass(frozen=True)
class Fault:
    """One system fault at ``t_s`` seconds: ``kind`` plus its parameters."""

    t_s: float
    kind: str
    gateway: int = 0
    worker: int = 0
    org: int = 0
    usd: str = ""
    state: str = ""     # maintenance: "on" / "off"


@dataclass(frozen=True)
class Plan:
    seed: int
    duration_s: float
    rate_per_s: float
    actions: tuple = field(default_factory=tuple)
    faults: tuple = field(default_factory=tuple)


def build_plan(seed, duration_s, rate_per_s=6.0):
    """Draw the whole schedule of a run from ``seed``.

    :param duration_s: seconds of traffic; faults stop 5 s before the end.
    :param rate_per_s: mean client actions per second (Poisson arrivals).
    """
    rng = random.Random(seed)
    actions, t = [], rng.expovariate(rate_per_s)
    while t < duration_s:
        actions.append(_action(rng, len(actions), round(t, 3)))
        t += rng.expovariate(rate_per_s)
    faults = _faults(rng, duration_s)
    return Plan(seed, duration_s, rate_per_s, tuple(actions), tuple(faults))


def fingerprint(plan):
    """Return a short hash of ``plan``: equal for equal schedules."""
    return hashlib.sha256(repr(asdict(plan)).encode()).hexdigest()[:16]


def _pick(rng, weights):
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def _upstream(rng, kind=None):
    kind = kind or _pick(rng, UPSTREAM_KINDS)
    return Upstream(kind=kind, chunks=rng.randint(1, 10), delay_s=rng.choice((0, 0, 0.02, 0.1)),
                    variant=rng.randrange(4), cut_after=rng.randint(0, 3))


def _action(rng, index, t_s):
    kind = _pick(rng, CLIENT_KINDS)
    org = rng.choices(range(len(ORGS)), weights=ORG_WEIGHTS)[0]
    fields = dict(id=index, t_s=t_s, kind=kind, org=org, gateway=rng.randrange(GATEWAYS),
                  model=rng.choices(MODELS, weights=MODEL_WEIGHTS)[0],
                  stream=kind in ("stream", "slow_reader", "burst") or (
                      kind in ("disconnect", "stale_key") and rng.random() < 0.6),
                  max_tokens=rng.choice((None, 16, 64, 128, 256)),
                  upstream=_upstream(rng), filler=rng.choice((0, 0, 40, 400, 3000)))
    if kind == "disconnect":
        fields.update(disconnect_at=rng.choice(("mid_send", "before_headers", "after_bytes",
                                                "after_bytes")),
                      disconnect_bytes=rng.randint(0, 1500),
                      disconnect_delay_s=rng.choice((0, 0.05, 0.3, 1.0)))
        fields["upstream"] = Upstream(kind=fields["upstream"].kind, chunks=rng.randint(2, 12),
                                      delay_s=rng.choice((0.02, 0.1, 0.2)),
                                      variant=fields["upstream"].variant)
    elif kind == "slow_reader":
        upstream = Upstream(kind=fields["upstream"].kind, chunks=rng.randint(3, 8),
                            pad=rng.choice((512, 4096, 16384)), variant=fields["upstream"].variant)
        read_bytes = rng.choice((16, 256, 1024))
        # Pace the reads so that the whole reply takes about this long to read.
        read_s = rng.choice((0.5, 2.0, 6.0, 15.0))
        fields.update(upstream=upstream, read_bytes=read_bytes,
                      read_pause_s=round(read_s * read_bytes / (upstream.chunks * upstream.pad), 4))
    elif kind == "burst":
        fields.update(size=ORGS[org][0] + rng.randint(1, 3), max_tokens=16,
                      upstream=Upstream(kind="ok", chunks=8, delay_s=0.25))
    elif kind == "bad_body":
        fields.update(bad_body=rng.choice(BAD_BODIES), upstream=Upstream())
    return Action(**fields)


def _faults(rng, duration_s):
    start, end = min(2.0, duration_s / 4), max(duration_s - 5.0, duration_s / 2)
    faults = []
    for kind, gap_s in FAULT_MEAN_GAP_S.items():
        times = [rng.uniform(start, start + 0.8 * (end - start))]
        t = start + rng.expovariate(1 / gap_s)
        while t < end:
            times.append(t)
            t += rng.expovariate(1 / gap_s)
        for t in times:
            faults.extend(_fault(rng, kind, round(t, 3), end))
    faults.sort(key=lambda f: (f.t_s, f.kind))
    return faults


def _fault(rng, kind, t_s, end_s):
    org = rng.randrange(len(ORGS))
    if kind == "worker_kill":
        return [Fault(t_s, kind, gateway=rng.randrange(GATEWAYS), worker=rng.randrange(2))]
    if kind == "hup":
        return [Fault(t_s, kind, gateway=rng.randrange(GATEWAYS))]
    if kind == "sql_topup":
        return [Fault(t_s, kind, org=org, usd=f"{rng.randint(20, 300) / 100:.2f}")]
    if kind == "sql_correction":
        return [Fault(t_s, kind, org=org, usd=f"-{rng.randint(1, 200) / 100:.2f}")]
    if kind == "key_revoke":
        return [Fault(t_s, kind, org=org)]
    if kind == "maintenance":
        off_s = min(t_s + rng.uniform(1.0, 4.0), end_s)
        return [Fault(t_s, kind, state="on"), Fault(round(off_s, 3), kind, state="off")]
    return [Fault(t_s, kind)]
