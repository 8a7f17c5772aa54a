"""The target table: Kiln's ratios to its yardsticks, measured in one run.

Every row is a ratio of two targets measured side by side in the same run (or a count), set
against the issue's target, so that a run on a busy or slow machine still says whether Kiln
meets it. Ratios are taken between medians over the rounds (the values of the detailed table,
so that they can be checked by hand); with several rounds the spread of the same ratio taken
round by round follows in brackets, to show how far one noisy round could move it.

"added" is a target's value minus direct's (the time the gateway adds to the fake upstream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from report import aggregate
from scenarios import (DIRECT, ENDPOINTS, ENDPOINTS_CONNS, FLOOR, KILN, LITELLM, NOMETER,
                       ORGS_CONNS, RESPONSES_TURNS)


@dataclass(frozen=True)
class Goal:
    """One row: a value computed from one scenario's targets, and its bound."""

    label: str
    scenario: str
    needs: tuple  # the targets the value is computed from
    value: Callable[[dict], float | None]  # {target: {field: value}} -> measured
    bound: float
    higher_is_better: bool
    style: str = "ratio"  # "ratio" (0.8×) | "inverse" (1/5) | "count"

    def target_text(self) -> str:
        sign = "≥" if self.higher_is_better else "≤"
        if self.style == "count":
            return f"{sign} {self.bound:g}"
        if self.style == "inverse":
            return f"{sign} 1/{1 / self.bound:g}"
        return f"{sign} {self.bound:g}×"

    def met(self, value: float) -> bool:
        return value >= self.bound if self.higher_is_better else value <= self.bound


def _get(vals: dict, target: str, field: str):
    return (vals.get(target) or {}).get(field)


def _ratio(num, den):
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _added(vals: dict, target: str, field: str):
    value, direct = _get(vals, target, field), _get(vals, DIRECT, field)
    return None if value is None or direct is None else value - direct


def raw_ratio(a: str, b: str, field: str):
    """``a``'s value over ``b``'s."""
    return lambda vals: _ratio(_get(vals, a, field), _get(vals, b, field))


def added_ratio(a: str, b: str, field: str):
    """What ``a`` adds over direct, over what ``b`` adds."""
    return lambda vals: _ratio(_added(vals, a, field), _added(vals, b, field))


def dialect_ratio(field: str):
    """What Kiln adds over direct on another API (``field``), over what it adds on chat
    (``chat_<field>``), both measured on one Kiln seconds apart (bench/scenarios.py,
    ``responses_run``, ``messages_run``, ``upstream_api_run``); each over direct's value of the
    same field, which for an API the fake upstream lacks (Messages, Responses) is chat's."""
    def value(vals):
        direct, direct_chat = _get(vals, DIRECT, field), _get(vals, DIRECT, f"chat_{field}")
        other, chat = _get(vals, KILN, field), _get(vals, KILN, f"chat_{field}")
        if None in (direct, direct_chat, other, chat):
            return None
        return _ratio(other - direct, chat - direct_chat)
    return value


def metering_in_commits(vals: dict):
    """What metering adds to the p50 at one connection (metered minus unmetered, ms), in
    durable one-row commits on the same database, measured in the same run."""
    metered, unmetered = _get(vals, KILN, "p50_ms"), _get(vals, NOMETER, "p50_ms")
    if metered is None or unmetered is None:
        return None
    return _ratio(metered - unmetered, _get(vals, KILN, "commit_ms"))


def kiln_ratio(num: str, den: str):
    """Kiln's field ``num`` over its field ``den``, measured in one scenario."""
    return lambda vals: _ratio(_get(vals, KILN, num), _get(vals, KILN, den))


def relay_ratio(a: str, b: str):
    """``a``'s streamed chunks per CPU-second over ``b``'s, or ``None`` when either lost a
    chunk or a stream (bench/relay_probe.py): a relay that drops chunks cannot meet a bound."""
    def value(vals):
        if _get(vals, a, "errors") or _get(vals, b, "errors"):
            return None
        return raw_ratio(a, b, "chunks_per_cpu_s")(vals)
    return value


def not_open(vals: dict):
    """Kiln's streams that were not open through the whole hold (errors included)."""
    streams = _get(vals, KILN, "streams")
    opened = [_get(vals, KILN, f) for f in ("open_at_hold", "held_to_end")]
    if streams is None or None in opened:
        return None
    return streams - min(opened)


def goals(open_counts, litellm_version: str = "") -> list:
    """The rows, in the issue's order."""
    lite = f"LiteLLM {litellm_version}".strip()
    rows = [
        Goal("metered / unmetered throughput, 64 conns, one org", "tput_c64",
             (KILN, NOMETER), raw_ratio(KILN, NOMETER, "rps"), 0.85, True),
        Goal(f"same with {ORGS_CONNS} orgs (one connection each)", f"orgs_c{ORGS_CONNS}",
             (KILN, NOMETER), raw_ratio(KILN, NOMETER, "rps"), 0.85, True),
        Goal("added p50 at 1 conn, metered / unmetered", "nonstream_c1",
             (DIRECT, KILN, NOMETER), added_ratio(KILN, NOMETER, "p50_ms"), 1.25, False),
        Goal("metered minus unmetered p50 at 1 conn, in durable commits (same run)",
             "nonstream_c1", (KILN, NOMETER), metering_in_commits, 1.5, False),
        Goal("/v1/messages added p50 at 1 conn / chat's", "messages_c1",
             (DIRECT, KILN), dialect_ratio("p50_ms"), 1.2, False),
        Goal("/v1/responses added p50 at 1 conn / chat's", "responses_c1",
             (DIRECT, KILN), dialect_ratio("p50_ms"), 1.2, False),
        Goal(f"/v1/responses with a {RESPONSES_TURNS}-turn previous_response_id: added p50 / "
             f"chat's", f"responses_prev{RESPONSES_TURNS}_c1", (DIRECT, KILN),
             dialect_ratio("p50_ms"), 1.5, False),
        *[Goal(f"/v1/{name} added p50 at 1 conn / chat's", f"{name}_c1", (DIRECT, KILN),
               dialect_ratio("p50_ms"), 1.2, False) for name in ("completions", "embeddings")],
        *[Goal(f"/v1{path} throughput at {ENDPOINTS_CONNS} conns / chat's",
               f"endpoints_c{ENDPOINTS_CONNS}", (KILN,), kiln_ratio(f"{name}_rps", "chat_rps"),
               1 / 1.2, True, "inverse") for name, (path, _) in ENDPOINTS.items()],
        Goal(f"throughput vs {lite}, 16 conns", "tput_c16",
             (KILN, LITELLM), raw_ratio(KILN, LITELLM, "rps"), 5, True),
        Goal(f"throughput vs {lite}, 64 conns", "tput_c64",
             (KILN, LITELLM), raw_ratio(KILN, LITELLM, "rps"), 5, True),
        Goal("added time to first SSE event vs LiteLLM's (p50, 64×20 ms stream)", "stream_20ms",
             (DIRECT, KILN, LITELLM), added_ratio(KILN, LITELLM, "ttft_p50_ms"), 0.2, False,
             "inverse"),
        Goal("unmetered vs the stack's floor: added p50 at 1 conn", "nonstream_c1",
             (DIRECT, NOMETER, FLOOR), added_ratio(NOMETER, FLOOR, "p50_ms"), 1.3, False),
        Goal("unmetered vs the stack's floor: throughput at 64 conns", "tput_c64",
             (NOMETER, FLOOR), raw_ratio(NOMETER, FLOOR, "rps"), 0.85, True),
        Goal("metered vs the stack's floor: stream chunks relayed per CPU-second (unpaced)",
             "stream_fast", (KILN, FLOOR), relay_ratio(KILN, FLOOR), 0.7, True),
        Goal(f"stream chunks relayed per CPU-second vs {lite} (unpaced)",
             "stream_fast", (KILN, LITELLM), relay_ratio(KILN, LITELLM), 1, True),
        Goal(f"chunk gap p99 vs {lite} (64×1 ms stream)", "stream_1ms",
             (KILN, LITELLM), raw_ratio(KILN, LITELLM, "gap_p99_ms"), 1, False),
    ]  # fmt: skip
    for n in open_counts:
        rows += [
            Goal(f"{n:,} streams opened at once: failed (not open through the hold)",
                 f"open_{n}", (KILN,), not_open, 0, False, "count"),
            Goal(f"{n:,} streams opened at once: time to open all vs direct", f"open_{n}",
                 (DIRECT, KILN), raw_ratio(KILN, DIRECT, "open_s"), 5, False),
            Goal(f"{n:,} streams opened at once: gateway memory per open stream, KiB",
                 f"open_{n}", (KILN,), lambda vals: _get(vals, KILN, "rss_per_stream_kb"), 48,
                 False, "count"),
        ]  # fmt: skip
    return rows


def _fmt(goal: Goal, value: float) -> str:
    if goal.style == "count":
        return f"{value:,.0f}"
    if goal.style == "inverse" and 0 < value < 1:
        return f"1/{1 / value:.3g}"
    return f"{value:.3g}×"


def _per_round(goal: Goal, results: dict) -> list:
    """The goal's value round by round, where every target it needs has that round."""
    per_target = results.get(goal.scenario, {})
    rounds = min((len(per_target.get(t, [])) for t in goal.needs), default=0)
    values = [goal.value({t: per_target[t][i] for t in goal.needs}) for i in range(rounds)]
    return [v for v in values if v is not None]


def _measured(goal: Goal, results: dict, agg: dict) -> tuple:
    """``(measured text, met text)``."""
    per_target = results.get(goal.scenario, {})
    missing = [t for t in goal.needs if t not in per_target]
    if missing:
        return f"not measured (no {', '.join(missing)})", "—"
    value = goal.value(agg.get(goal.scenario, {}))
    if value is None:
        return "no value: a run failed (see the detailed table and logs)", "no"
    text = _fmt(goal, value)
    if (
        goal.style != "count"
        and goal.scenario.startswith("open_")
        and not_open(agg.get(goal.scenario, {}))
    ):
        text = f"≥ {text} (not all opened)"
        return text, "no"
    spread = _per_round(goal, results)
    if len(spread) > 1:
        low, high = min(spread), max(spread)
        text += f" (rounds {_fmt(goal, low)}–{_fmt(goal, high)})"
    return text, "yes" if goal.met(value) else "no"


def table(results: dict, open_counts, litellm_version: str = "") -> list:
    """Markdown lines: metric, measured ratio, target, met?"""
    agg = aggregate(results)
    lines = ["| metric | measured | target | met? |", "|---|---|---|---|"]
    for goal in goals(open_counts, litellm_version):
        measured, met = _measured(goal, results, agg)
        lines.append(f"| {goal.label} | {measured} | {goal.target_text()} | {met} |")
    return lines
