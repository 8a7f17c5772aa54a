"""Fake backends of a chaos run: the scripted fake upstream (``fake_upstream``) answering each
request as the schedule says.

Every chat request a chaos client sends carries a marker in its first message,
``[chaos ACTION.SUB org ORG]``; the backend looks the action up in the plan and plays its
:class:`chaos_plan.Upstream`: a normal reply, or one of the faults (reset, 500, hang, garbage,
usage lies). The ``meter`` backend also behaves like llama.cpp's server: no usage chunk in
streams, and a ``/extras/tokenize/count`` endpoint (README, "Metering").
"""
import re
import threading
from collections import Counter

from chaos_plan import Upstream
from fake_upstream import (Close, FakeUpstream, Hang, Reset, Send, Sleep, Status, chat_chunk,
                           chat_completion, error_reply, json_reply, make_usage, sse)

MARKER = re.compile(r"\[chaos (\d+)\.(\d+) org (\d+)\]")
TOKENIZE_PATH = "/extras/tokenize/count"


def marker(action_id, sub, org):
    """Return the marker text that ties a request to its scheduled action."""
    return f"[chaos {action_id}.{sub} org {org}]"


def parse_marker(body):
    """Return ``(action id, sub, org)`` from a forwarded chat body, or None."""
    try:
        text = body["messages"][0]["content"]
        found = MARKER.search(text)
    except (KeyError, IndexError, TypeError):
        return None
    return tuple(int(g) for g in found.groups()) if found else None


class Backends:
    """The fake backends of a run and what they served.

    ``served`` counts the backend behaviours actually played (``Upstream.kind``), so that the
    figures show faults that reached the gateway, not only faults that were planned.
    """

    def __init__(self, plan, count=3):
        self.actions = {a.id: a for a in plan.actions}
        self.served = Counter()
        self._lock = threading.Lock()
        self.fakes = [FakeUpstream(default=self._responder(meter=False)) for _ in range(count)]
        self.fakes.append(FakeUpstream(default=self._responder(meter=True)))

    def __enter__(self):
        for fake in self.fakes:
            fake.start()
        return self

    def __exit__(self, *exc):
        for fake in self.fakes:
            fake.stop()

    @property
    def meter(self):
        return self.fakes[-1]

    def records(self):
        """Return every request every backend received (``fake_upstream.RequestRecord``)."""
        return [r for fake in self.fakes for r in fake.requests]

    def errors(self):
        """Return the fakes' own responder failures (tracebacks): a bug in the harness."""
        return [e for fake in self.fakes for e in fake.errors]

    def _responder(self, meter):
        def respond(record):
            path = record.path.split("?", 1)[0]
            body = record.json if isinstance(record.json, dict) else {}
            if path.endswith(TOKENIZE_PATH):
                text = body.get("input") if isinstance(body.get("input"), str) else ""
                return json_reply({"count": max(1, len(text.encode()) // 4)})
            if record.method != "POST" or not path.endswith("/chat/completions"):
                return error_reply(404, f"no route for {record.method} {path}")
            found = parse_marker(body)
            action = self.actions.get(found[0]) if found else None
            spec = action.upstream if action else None
            kind = spec.kind if spec else "ok"
            with self._lock:
                self.served[kind] += 1
            return script(spec, body, len(record.body), meter)
        return respond


def script(spec, body, body_bytes, meter=False):
    """Return the fake_upstream script for one request.

    :param spec: :class:`chaos_plan.Upstream`, or None for a plain normal reply.
    :param body: the JSON body the gateway forwarded.
    :param meter: behave like llama.cpp's server (no usage chunk in streams).
    """
    spec = spec or Upstream()
    prompt = max(1, body_bytes // 4)
    usage = _usage(spec, prompt)
    if spec.kind == "error_500":
        return _server_error(spec)
    if spec.kind == "hang" and spec.variant % 2 == 0:
        return [Hang()]
    if spec.kind == "garbage" and spec.variant == 0:
        return [Send(b"\x16\x03\x01\x00\xffnot http at all\r\n\r\n"), Close()]
    if body.get("stream"):
        return _stream(spec, body, usage, meter and spec.kind == "ok")
    return _reply(spec, body, usage)


def _usage(spec, prompt):
    honest = make_usage(prompt=prompt, completion=spec.chunks)
    lies = {
        "usage_null": None,
        "usage_negative": {"prompt_tokens": -5, "completion_tokens": -100,
                           "total_tokens": -105},
        "usage_string": ("lots" if spec.variant % 2 else
                         {"prompt_tokens": str(prompt), "completion_tokens": "7",
                          "total_tokens": "x"}),
        "usage_huge": {"prompt_tokens": 10 ** 8, "completion_tokens": 10 ** 9,
                       "total_tokens": 11 * 10 ** 8,
                       "prompt_tokens_details": {"cached_tokens": 10 ** 7}},
    }
    return lies.get(spec.kind, honest)


def _server_error(spec):
    if spec.variant == 1:
        return error_reply(500, "backend exploded", plain=True)
    if spec.variant == 2:
        return error_reply(503, "backend overloaded")
    if spec.variant == 3:
        return [Sleep(0.2)] + error_reply(500, "backend exploded late")
    return error_reply(500, "backend exploded")


def _words(spec):
    pad = "x" * spec.pad
    return [f"word{i}{pad} " for i in range(spec.chunks)]


def _reply(spec, body, usage):
    model = body.get("model", "upstream")
    if spec.kind == "garbage":
        garbage = {1: b"{not json at all \xff\xfe", 2: b"[1, 2, 3]",
                   3: b'{"choices": [{"message": 5}], "usage": {"prompt_tokens": 3}}'}
        raw = garbage[spec.variant]
        head = {"Content-Type": "application/json", "Content-Length": str(len(raw))}
        return [Status(200, head, chunked=False), Send(raw)]
    obj = chat_completion("".join(_words(spec)), model=model)
    obj["usage"] = usage
    steps = json_reply(obj)
    if spec.kind in ("reset", "hang"):
        status, send = steps
        cut = Send(send.data[:max(1, len(send.data) // 2)])
        return [status, cut, Reset() if spec.kind == "reset" else Hang()]
    return steps


def _stream(spec, body, usage, no_usage):
    model = body.get("model", "upstream")
    words = _words(spec)
    events = [chat_chunk(w, role="assistant" if i == 0 else None, model=model)
              for i, w in enumerate(words)]
    if spec.kind == "garbage":
        events.insert(min(1, len(events)), {1: b"data: {not json \xff\xfe\n\n",
                                            2: b"\xff\xfe\x00 unframed bytes\n",
                                            3: b'data: {"choices": "nope"}\n\n'}[spec.variant])
    if spec.kind in ("reset", "hang"):
        steps = sse(events[:spec.cut_after], delay_s=spec.delay_s, done=False)
        return steps + [Reset() if spec.kind == "reset" else Hang()]
    events.append(chat_chunk(finish_reason="stop", model=model))
    if not no_usage:
        usage_chunk = chat_chunk(choices=False, model=model)
        usage_chunk["usage"] = usage
        events.append(usage_chunk)
    return sse(events, delay_s=spec.delay_s)
