"""Streamed chunks a target relays per second, and per CPU-second of its own processes.

``streams`` clients at once, each on a keep-alive socket of its own, ask for streamed chat
completions of ``chunks`` text chunks, each with a text of its own (``distinct=1``), that the
fake upstream writes with no pause between them (``gap_ms=0``: as fast as it can), ending with a
usage chunk (``stream_options: {include_usage: true}``, which bench/httpio.py's ``chat_body``
sets) and ``data: [DONE]``.
Each client asks for one stream after another until ``seconds`` have passed; the streams under
way then finish. Every stream is read to its end and its text chunks counted (bench/
stream_probe.py's ``read_stream``): a stream with fewer or more text chunks than the upstream
sent, no usage chunk or no ``[DONE]`` is an error, and so is one that fails (its client stops
there).

The user + system CPU seconds (/proc) of the target's processes, the PIDs it was started with
and their descendants (a gunicorn master and its workers, LiteLLM and its workers), are read
before and after the streams. Only the processes there at both reads count: one that started
or ended in between (a worker restarted) is left out, and counted in ``processes_changed``.
:func:`relay` returns:

* ``chunks_per_s``: text chunks the clients received per second of wall time;
* ``chunks_per_cpu_s``: the same chunks per CPU-second of the target's processes, i.e. what
  one fully busy core of the target relays;
* ``busy_cores``: those CPU-seconds per wall second;
* ``chunks`` (text chunks received), ``streams`` (read whole), ``errors``, ``error_samples``,
  ``processes_changed``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import targets as tg
from httpio import build_chat_request, chat_body
from procstat import tree_cpu
from stream_probe import StreamFailed, connect, read_stream


def incomplete(result: dict, chunks: int) -> str | None:
    """What a stream read to its end lacks, or ``None`` when it is whole."""
    if result["events"] == chunks and result["usage"] and result["done"]:
        return None
    return (
        f"{result['events']}/{chunks} text chunks, usage chunk {result['usage']}, "
        f"[DONE] {result['done']}"
    )


def client(base_url: str, request: bytes, chunks: int, deadline: float) -> tuple:
    """Read streams one after another on one socket until ``deadline`` (``time.monotonic``).

    Returns ``(text chunks received, streams read whole, errors)``.
    """
    received, whole, errors, sock = 0, 0, [], None
    try:
        while time.monotonic() < deadline:
            try:
                sock = sock or connect(base_url, timeout=120)
                result, keep_alive = read_stream(sock, request)
            except (OSError, StreamFailed, ValueError) as exc:
                errors.append(str(exc))
                break
            received += result["events"]
            problem = incomplete(result, chunks)
            if problem:
                errors.append(problem)
            else:
                whole += 1
            if not keep_alive:
                sock.close()
                sock = None
    finally:
        if sock is not None:
            sock.close()
    return received, whole, errors


def cpu_between(before: dict, after: dict) -> tuple:
    """``(CPU seconds, processes that started or ended)`` between two :func:`tree_cpu` reads
    of one tree; only the processes in both reads count."""
    kept = before.keys() & after.keys()
    return sum(after[pid] - before[pid] for pid in kept), len(before.keys() ^ after.keys())


def relay(target: tg.Target, streams: int, chunks: int, seconds: float) -> dict:
    """``streams`` clients read unpaced ``chunks``-chunk streams through ``target`` for
    ``seconds``; count the chunks and the target's CPU time (see the module's docstring)."""
    body = chat_body(True, chunks, gap_ms=0, distinct=True)
    request = build_chat_request(target.base_url, target.api_key, body)
    cpu0, t0 = tree_cpu(target.pids), time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        runs = list(
            pool.map(lambda _: client(target.base_url, request, chunks, t0 + seconds),
                     range(streams))
        )  # fmt: skip
    wall = time.monotonic() - t0
    cpu, changed = cpu_between(cpu0, tree_cpu(target.pids))
    received = sum(r[0] for r in runs)
    errors = [e for r in runs for e in r[2]]
    return {
        "chunks_per_s": received / wall,
        "chunks_per_cpu_s": received / cpu if cpu > 0 else None,
        "busy_cores": cpu / wall,
        "chunks": received,
        "streams": sum(r[1] for r in runs),
        "errors": len(errors),
        "error_samples": errors[:3],
        "processes_changed": changed,
    }
