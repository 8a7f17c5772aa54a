"""Process-memory and Postgres-connection sampling for the benchmarks (Linux)."""

from __future__ import annotations

import os
import subprocess


def _ppid(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # Field 4 follows the ")" closing the command name, which may hold spaces.
    return int(data[data.rindex(b")") + 2 :].split()[1])


def process_tree(pids) -> list:
    """The given PIDs plus all their live descendants."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _ppid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    seen, todo = [], [p for p in pids if os.path.exists(f"/proc/{p}")]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, ()))
    return sorted(seen)


def process_cpu(pid: int):
    """User + system CPU seconds used so far by one process, or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids) -> float:
    """User + system CPU seconds used so far by the given processes (gone ones count 0)."""
    return sum(process_cpu(pid) or 0 for pid in pids)


def tree_cpu(pids) -> dict:
    """``{pid: CPU seconds so far}`` of the PIDs and all their live descendants."""
    cpu = {pid: process_cpu(pid) for pid in process_tree(pids)}
    return {pid: seconds for pid, seconds in cpu.items() if seconds is not None}


def pids_named(name: str) -> list:
    """PIDs of every process whose command name is ``name`` (e.g. ``postgres``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as fh:
                    if fh.read().strip() == name:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def rss_kb(pid: int) -> int:
    """VmRSS of one process in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kb(pids) -> int:
    """Summed VmRSS of the PIDs and all their descendants, in KiB."""
    return sum(rss_kb(p) for p in process_tree(pids))


def pg_connections(dsn: str, datname: str):
    """``(total, not_idle)`` backends connected to ``datname``, or ``None``.

    Uses the ``psql`` client so no driver is needed; ``dsn`` should name a
    different database (e.g. ``postgres``) so this session is not counted.
    """
    sql = (
        "SELECT count(*), count(*) FILTER (WHERE state IS DISTINCT FROM 'idle') "
        "FROM pg_stat_activity WHERE datname = :'db';"
    )
    try:
        out = subprocess.run(
            ["psql", dsn, "-X", "-A", "-t", "-F", " ", "-v", f"db={datname}"],
            input=sql,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
