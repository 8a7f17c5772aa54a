#!/usr/bin/env python3
"""Big answers: what one whole (non-stream) reply costs the worker that relays it.

A non-stream reply is read whole, parsed, metered and written again in the client's dialect
in the worker's event loop (gateway/flow/answers.py ``complete``). Parsing and writing JSON
hold the interpreter from start to end, so every other stream of that worker waits meanwhile,
and the parsed reply lives in the worker's memory until it is written. This measures both for
replies of growing size, of two shapes:

- ``text``: one choice whose content is one long string (the cheapest to parse per byte);
- ``logprobs``: a chat completion with ``logprobs`` and ``top_logprobs`` 20 (OpenAI's
  ``choices[].logprobs.content``, each token with its 20 alternatives): many small objects,
  the most expensive per byte.

For each, in a fresh process: the seconds to parse (Kiln's own parse), to count (the meter)
and to write (the chat codec), each on its own; then the longest stall a greenlet ticking
every millisecond saw while Kiln's own path for a whole reply ran
(:func:`gateway.flow.answers.complete`, with the reply read already: parse, meter, rules,
write, with the event loop's turns between them); the peak of memory traced while it ran
(tracemalloc). Figures to bench/RESULTS.md,
"Big answers"; the bound they support is docs/RELIABILITY.md's.

    .venv/bin/python bench/big_answers.py [--sizes 1,4,16,64] [--shapes text,logprobs]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1024 * 1024


def entry(i):
    """One token's log-probability entry with 20 alternatives (OpenAI's shape)."""
    alt = [{"token": f" tok{i % 997}_{j}", "logprob": -1.2345678901234 - j,
            "bytes": [32, 116, 111, 107]} for j in range(20)]
    return {"token": f" tok{i % 997}", "logprob": -0.123456789012345,
            "bytes": [32, 116, 111, 107], "top_logprobs": alt}


def reply(shape, size):
    """A chat completion of about ``size`` bytes, as JSON bytes."""
    base = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "m",
            "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}}
    if shape == "text":
        text = "lorem ipsum " * (size // 12)
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "length", "logprobs": None}
        return json.dumps({**base, "choices": [choice]}).encode()
    one = len(json.dumps(entry(0))) + 2
    count = max(1, size // one)
    content = [entry(i) for i in range(count)]
    choice = {"index": 0, "message": {"role": "assistant", "content": " tok" * count},
              "finish_reason": "length", "logprobs": {"content": content}}
    return json.dumps({**base, "choices": [choice]}).encode()


def measure(shape, size_mib):
    """Run one case in this process; print one JSON line of figures."""
    import gevent

    from gateway.billing import Usage
    from gateway.dialects.chat import ChatCodec
    from gateway.flow.answers import _parse_completion, complete
    from gateway.flow.metering import Meter

    raw = reply(shape, size_mib * MiB)
    gaps = []

    def ticker():
        last = time.perf_counter()
        while True:
            gevent.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    def steps():
        t0 = time.perf_counter()
        completion = _parse_completion(raw)
        t1 = time.perf_counter()
        Meter(10 ** 9).observe_completion(completion)
        t2 = time.perf_counter()
        ChatCodec().render_json(completion, Usage(prompt=10, completion=1), Decimal("0.001"),
                                SimpleNamespace())
        t3 = time.perf_counter()
        del completion
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    def kiln_path():
        """gateway.flow.answers.complete over the reply, read already."""
        meter = Meter(10 ** 9)
        gen = SimpleNamespace(meter=meter, mark_first_token=lambda: None,
                              final_usage=lambda: Usage(prompt=10, completion=1))
        exchange = SimpleNamespace(reply_bytes=len(raw),
                                   send_and_read=lambda parse: parse(raw))
        request = SimpleNamespace(stop=(), single_tool_call=False)
        path = complete(gen, exchange, request, ChatCodec())
        next(path)  # the head
        try:
            next(path)
        except StopIteration as end:
            return len(end.value(Decimal("0.001")))

    parse_s, meter_s, render_s, free_s = steps()
    tick = gevent.spawn(ticker)
    gevent.sleep(0.01)
    gaps.clear()
    out_bytes = gevent.spawn(kiln_path).get()
    gevent.sleep(0.01)
    tick.kill()
    tracemalloc.start()
    kiln_path()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"shape": shape, "size_mib": size_mib, "reply_bytes": len(raw),
                      "parse_s": parse_s, "meter_s": meter_s, "render_s": render_s,
                      "free_s": free_s, "stall_ms": max(gaps) * 1000,
                      "traced_peak_mib": peak / MiB,
                      "out_bytes": out_bytes}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,8,16,32,64", help="reply sizes, MiB")
    parser.add_argument("--shapes", default="text,logprobs")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "MIB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        measure(args.one[0], int(args.one[1]))
        return
    print("| shape | reply | parse | meter | write | longest stall | traced peak |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", shape, str(size)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {shape} | {r['reply_bytes'] / MiB:.1f} MiB | {r['parse_s'] * 1000:.0f} ms "
                  f"| {r['meter_s'] * 1000:.0f} ms | {r['render_s'] * 1000:.0f} ms "
                  f"| {r['stall_ms']:.0f} ms | {r['traced_peak_mib']:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
