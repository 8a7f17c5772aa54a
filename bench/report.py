"""Turn per-round measurements into the comparison table and bench/RESULTS.md."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from httpio import median
from scenarios import ENDPOINTS, TARGETS

GATEWAYS = ("kiln", "litellm")


@dataclass(frozen=True)
class Metric:
    """One table row: ``field`` of scenario ``scenario``."""

    scenario: str
    field: str
    label: str
    better: str = "lower"  # or "higher"
    additive: bool = True  # compare gateways by what they add over direct
    only_if_nonzero: bool = False


_RAW = {"additive": False}  # compare raw values, not what a gateway adds
_HIGHER = {"better": "higher", "additive": False}
_IF_ANY = {"additive": False, "only_if_nonzero": True}

# kind -> rows of (field, label, Metric options)
ROWS = {
    "wrk": [
        ("p50_ms", "p50 ms", {}),
        ("p99_ms", "p99 ms", {}),
        ("rps", "req/s", _HIGHER),
        ("errors", "errors", _IF_ANY),
        ("cpu_ms", "CPU ms/request, the target's processes", _RAW),
        ("pg_cpu_ms", "CPU ms/request, Postgres", _IF_ANY),
        ("commit_ms", "a durable one-row commit on its database, ms", _IF_ANY),
    ],
    "dialect": [  # another API beside chat, on the same target (bench/scenarios.py)
        ("p50_ms", "p50 ms", {}),
        ("chat_p50_ms", "chat's p50 ms", {}),
        ("rps", "req/s", _HIGHER),
        ("chat_rps", "chat's req/s", _HIGHER),
        ("errors", "errors", _IF_ANY),
    ],
    "endpoints": [  # every endpoint beside chat, on the same target (bench/scenarios.py)
        ("chat_rps", "chat req/s", _HIGHER),
        *[(f"{name}_rps", f"/v1{path} req/s", _HIGHER) for name, (path, _) in ENDPOINTS.items()],
        ("errors", "errors", _IF_ANY),
    ],
    "stream": [
        ("ttft_p50_ms", "TTFT p50 ms", {}),
        ("gap_p99_ms", "chunk gap p99 ms", {}),
        ("total_p50_ms", "total p50 ms", {}),
        ("errors", "errors", _IF_ANY),
    ],
    "relay": [  # unpaced streams at once (bench/relay_probe.py)
        ("chunks_per_s", "chunks/s received", _HIGHER),
        ("chunks_per_cpu_s", "chunks per CPU-second of the target's processes", _HIGHER),
        ("busy_cores", "cores busy (target's CPU-seconds per second)", _RAW),
        ("errors", "streams failed or incomplete", _IF_ANY),
        ("processes_changed", "processes started or ended (their CPU left out)", _IF_ANY),
    ],
    "open": [
        ("errors", "errors", _RAW),
        ("held_to_end", "open through the hold", _HIGHER),
        ("open_s", "seconds to open all", _RAW),
        ("first_event_p99_ms", "first event p99 ms", {}),
        ("rss_per_stream_kb", "RSS KiB/stream", _RAW),
        ("rss_peak_kb", "RSS peak MiB", _RAW),
        ("pg_peak", "PG connections (peak)", _IF_ANY),
        ("pg_busy_peak", "PG connections busy (peak)", _IF_ANY),
        ("upstream_drain_s", "s until upstream streams stop after clients leave", _RAW),
        ("upstream_active_left", "upstream streams still running after the wait", _IF_ANY),
        ("processes_lost", "gateway processes that died or restarted", _IF_ANY),
    ],
}


def metrics_for(scenarios) -> list:
    """The rows to print, in scenario order."""
    return [
        Metric(sc.key, field, f"{sc.title}: {label}", **opts)
        for sc in scenarios
        for field, label, opts in ROWS[sc.kind]
    ]


def aggregate(results: dict) -> dict:
    """``results[scenario][target] = [round dicts]`` -> medians per field."""
    out = {}
    for scenario, per_target in results.items():
        for target, rounds in per_target.items():
            fields = {k for r in rounds for k, v in r.items() if isinstance(v, (int, float))}
            out.setdefault(scenario, {})[target] = {
                f: median([r.get(f) for r in rounds]) for f in fields
            }
    return out


def _fmt(value, field=""):
    """Render one cell."""
    if value is None:
        return "—"
    if field == "rss_peak_kb":
        return f"{value / 1024:,.0f}"
    if field == "rps":
        return f"{value:,.0f}"
    if float(value).is_integer() and not field.endswith(("_ms", "_s")):
        return f"{int(value):,}"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:,.1f}"


def _ratio(num, den):
    if num is None or den is None or den <= 0:
        return "—"
    return f"{num / den:.3g}×"


def _added(metric: Metric, value, direct) -> str:
    """What a gateway adds over direct, for latency-like rows."""
    if not metric.additive or value is None or direct is None:
        return "—"
    return f"+{_fmt(value - direct, metric.field)}".replace("+-", "−")


def _advantage(metric: Metric, values: dict) -> str:
    """How many times better Kiln is than LiteLLM on this row."""
    kiln, lite, direct = values.get("kiln"), values.get("litellm"), values.get("direct")
    if kiln is None or lite is None:
        return "—"
    if metric.better == "higher":
        return _ratio(kiln, lite)
    if metric.additive and direct is not None:
        return _ratio(lite - direct, kiln - direct)
    return _ratio(lite, kiln)


def table(scenarios, results: dict, targets) -> list:
    """Markdown table lines: values per target, ratios to direct, Kiln advantage."""
    agg = aggregate(results)
    names = [t for t in TARGETS if t in targets]
    gateways = [g for g in GATEWAYS if g in names]
    head = [
        "metric (median of rounds)",
        *names,
        *[f"{g} added" for g in gateways],
        *[f"{g}/direct" for g in gateways],
    ]
    if "kiln" in names and "litellm" in names:
        head.append("Kiln advantage")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for metric in metrics_for(scenarios):
        values = {n: agg.get(metric.scenario, {}).get(n, {}).get(metric.field) for n in names}
        if all(v is None for v in values.values()):
            continue
        if metric.only_if_nonzero and not any(values.values()):
            continue
        row = [metric.label, *[_fmt(values[n], metric.field) for n in names]]
        row += [_added(metric, values[g], values.get("direct")) for g in gateways]
        row += [_ratio(values[g], values.get("direct")) for g in gateways]
        if "kiln" in names and "litellm" in names:
            row.append(_advantage(metric, values))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def metering_lines(results: dict) -> list:
    """Kiln with metering on vs off, where both ran."""
    agg = aggregate(results)
    lines = []
    for scenario, per_target in agg.items():
        on, off = per_target.get("kiln"), per_target.get("kiln-nometer")
        if not on or not off:
            continue
        for field in ("p50_ms", "p99_ms", "rps", "ttft_p50_ms", "total_p50_ms"):
            if on.get(field) is not None and off.get(field) is not None:
                lines.append(
                    f"- {scenario} {field}: on {_fmt(on[field], field)}, "
                    f"off {_fmt(off[field], field)} "
                    f"(on/off {_ratio(on[field], off[field])})"
                )
    return lines


# --------------------------------------------------------------------------
# Environment description
# --------------------------------------------------------------------------


def _cmd(argv) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError):
        mem_kb = 0
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_kb / 1048576:.1f} GiB RAM, "
        f"{platform.system()} {platform.release()}, load avg at start {load}"
    )


def versions(targets) -> list:
    repo = Path(__file__).resolve().parent.parent
    lines = [
        f"- Python {platform.python_version()}",
        f"- {_cmd(['wrk', '--version'])}",
        f"- Postgres: {_cmd(['psql', '--version'])}",
        f"- Kiln checkout: {_cmd(['git', '-C', str(repo), 'describe', '--always', '--dirty'])}",
    ]
    for t in targets:
        extra = f", startup {t.startup_s:.1f} s (median)" if t.startup_s is not None else ""
        lines.append(f"- {t.name}: {t.version or 'n/a'}{extra}")
    return lines


def write_results(
    path: Path,
    *,
    started: str,
    command: str,
    mode: str,
    targets,
    goal_lines,
    table_lines,
    metering,
    notes,
    settings,
) -> None:
    """Write the Markdown report."""
    parts = [
        "# Kiln gateway benchmark",
        "",
        f"- Date: {started}",
        f"- Mode: {mode}",
        f"- Command: `{command}`",
        f"- Machine: {machine()}",
        "",
        "## Targets",
        "",
        *goal_lines,
        "",
        GOALS_NOTE,
        "",
        "## Versions",
        "",
        *versions(targets),
        "",
        "## Settings",
        "",
        *[f"- {s}" for s in settings],
        "",
        "## Results",
        "",
        *table_lines,
        "",
        "Values are medians over interleaved rounds (targets run in turn within each",
        "round). `X added` is the target's value minus direct's (time the gateway adds);",
        "`X/direct` divides by the direct-to-upstream value. *Kiln advantage*",
        "is how many times better Kiln is than LiteLLM: for latencies it compares the",
        "time each gateway adds over direct, for throughput and memory the raw values.",
        "",
    ]
    if metering:
        parts += ["## Kiln metering on vs off", "", *metering, ""]
    if notes:
        parts += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    path.write_text("\n".join(parts) + kept_analysis(path))


GOALS_NOTE = """\
Ratios of the medians in the table below, measured side by side in this run (in brackets: the
same ratio round by round). *added* is the time a target adds over direct access to the fake
upstream. *unmetered* is Kiln with `KILN_METERING=false`; *the stack's floor* is
bench/floor_app.py, a bare Flask relay on the same gunicorn gevent workers. The many-orgs
scenario gives each of its wrk connections its own thread and the key of its own org, and is
compared with Kiln unmetered driven the same way. Chunks relayed per CPU-second count the CPU
time of the target's own processes (gunicorn master and workers, LiteLLM and its workers; not
Postgres, not the upstream) while a few unpaced streams run at once."""

ANALYSIS_MARK = "<!-- analysis: written by hand, kept across runs -->"


def kept_analysis(path: Path) -> str:
    """Return the hand-written analysis at the end of an existing results file, if any."""
    if not path.exists():
        return ""
    text = path.read_text()
    at = text.find(ANALYSIS_MARK)
    return "\n" + text[at:] if at >= 0 else ""
