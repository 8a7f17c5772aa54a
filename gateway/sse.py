"""Server-sent events: framing on bytes, and the per-event rules Kiln owns in a stream.

Events are split on blank lines while still bytes and decoded only whole, so a chunk boundary
inside a multi-byte character or between the two newlines that end an event changes nothing
(WHATWG HTML, "Server-sent events"). Comment, ``event:``, ``id:`` and ``retry:`` lines are
dropped. A chunk that Kiln does not need to change leaves with its ``data`` payload unchanged,
byte for byte; Kiln changes only usage (strip it, or add ``cost``), stop strings, and the
single-tool-call rule.
"""
import json

DONE = b"[DONE]"
KEEPALIVE = b": keepalive\n\n"
_COST_MARK = "\x00kiln-cost\x00"


class EventSplitter:
    """Accumulate bytes and return whole events' ``data`` payloads."""

    def __init__(self):
        self._buf = b""

    def feed(self, data):
        """Add ``data``; return the list of complete data payloads (bytes) now available.

        Events with no ``data`` line (comments, keepalives) yield nothing.
        """
        buf = self._buf + data
        if b"\r" in buf:
            # Normalise CRLF and CR framing; hold a trailing CR back, it may start a CRLF.
            held = buf.endswith(b"\r")
            buf = buf[:-1] if held else buf
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if held else b"")
        *events, self._buf = buf.split(b"\n\n")
        return [p for p in map(_data_payload, events) if p is not None]

    @property
    def pending(self):
        """Bytes of an unfinished event (non-empty when a stream was cut mid-event)."""
        return self._buf.strip()


def _data_payload(event):
    if event.startswith(b"data:") and b"\n" not in event:
        return event[6:] if event[5:6] == b" " else event[5:]
    lines = [line[6:] if line[5:6] == b" " else line[5:]
             for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def frame(payload):
    """Return ``payload`` framed as one SSE data event."""
    return b"data: " + payload + b"\n\n"


def dumps(obj, cost_usd=None):
    """Serialise ``obj`` compactly; with ``cost_usd`` (Decimal) set ``usage.cost`` exactly.

    JSON has no decimal type; the cost is written as a plain decimal literal, never through a
    binary float.
    """
    if cost_usd is None:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    obj["usage"]["cost"] = _COST_MARK
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return text.replace(json.dumps(_COST_MARK), format(cost_usd.normalize(), "f")).encode()


class StopCutter:
    """Cut generated text before the first stop string, across chunk boundaries.

    The endpoint reference notes that generation runs past ``stop``; Kiln enforces it. Text that
    could be the start of a stop string is held back until the next delta decides.
    """

    def __init__(self, stops):
        self.stops = stops
        self._pending = {}
        self.finished = set()

    def feed(self, index, text):
        """Return ``(text to emit, hit)`` for a content delta of choice ``index``."""
        text = self._pending.pop(index, "") + text
        cut = min((p for p in (text.find(s) for s in self.stops) if p >= 0), default=-1)
        if cut >= 0:
            self.finished.add(index)
            return text[:cut], True
        keep = self._held_suffix(text)
        if keep:
            self._pending[index] = text[-keep:]
            text = text[:-keep]
        return text, False

    def flush(self, index):
        """Return the text held back for choice ``index`` (its stream ended)."""
        return self._pending.pop(index, "")

    def _held_suffix(self, text):
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best


def cut_at_stop(text, stops):
    """Return ``(text before the first stop string, whether one was found)``."""
    cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class StreamRules:
    """Apply Kiln's rules to each upstream data payload of a chat stream, and meter it.

    :param include_usage: the client asked for usage; otherwise no chunk keeps a usage field.
    :param stops: stop strings to enforce (may be empty).
    :param single_tool_call: keep only the first tool call (``index`` 0).
    :param price: ``usage dict -> Decimal USD`` billed for it, written as ``usage.cost``.
    """

    def __init__(self, include_usage, stops, single_tool_call, price):
        self.include_usage = include_usage
        self.cutter = StopCutter(stops) if stops else None
        self.single_tool_call = single_tool_call
        self.price = price
        self.usage = None        # the last non-null usage seen (running totals are not summed)
        self.deltas = 0          # content/tool-call deltas relayed: one token each, as estimated
        self.finished = set()    # choice indexes that carried a finish_reason
        self.done = False        # the upstream sent [DONE]
        self.error = None        # an error frame inside the stream
        self.chunk_id, self.created, self.model = None, 0, None  # for a synthesised usage chunk

    def apply(self, payload):
        """Return the framed bytes to send for ``payload``, or None to send nothing."""
        if payload == DONE:
            self.done = True
            return None
        try:
            obj = json.loads(payload)
        except ValueError:
            return frame(payload)
        if not isinstance(obj, dict):
            return frame(payload)
        if "error" in obj and not obj.get("choices"):
            self.error = obj["error"]
            return None
        return self._apply(obj, payload)

    def _apply(self, obj, payload):
        if self.chunk_id is None:
            self.chunk_id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get(
                "model")
        usage = obj.get("usage")
        had_choices = bool(obj.get("choices"))
        changed = False
        if usage is not None:
            self.usage = usage
        if "usage" in obj and not (self.include_usage and usage is not None):
            del obj["usage"]
            changed = True
        choices = obj.get("choices")
        if isinstance(choices, list):
            self._meter(choices)
            if self.cutter or self.single_tool_call:
                changed |= self._rewrite(obj, choices)
        if changed and not obj.get("choices") and "usage" not in obj and (had_choices or usage):
            return None
        if usage is not None and "usage" in obj:
            return frame(dumps(obj, self.price(usage)))
        return frame(dumps(obj)) if changed else frame(payload)

    def _meter(self, choices):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                self.deltas += 1
            if choice.get("finish_reason"):
                self.finished.add(choice.get("index", 0))

    def _rewrite(self, obj, choices):
        kept = []
        for choice in choices:
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            index = choice.get("index", 0)
            if self.cutter and index in self.cutter.finished:
                continue  # Kiln already ended this choice at a stop string
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if self.cutter:
                    self._cut(choice, delta, index)
                if self.single_tool_call:
                    _first_tool_call_only(delta)
            kept.append(choice)
        obj["choices"] = kept
        return True

    def _cut(self, choice, delta, index):
        content = delta.get("content")
        if isinstance(content, str) and content:
            delta["content"], hit = self.cutter.feed(index, content)
            if hit:
                choice["finish_reason"] = "stop"
                return
        if choice.get("finish_reason"):
            rest = self.cutter.flush(index)
            if rest:
                delta["content"] = (delta.get("content") or "") + rest


def _first_tool_call_only(container):
    calls = container.get("tool_calls")
    if isinstance(calls, list) and len(calls) > 0:
        first = [c for c in calls if isinstance(c, dict) and c.get("index", 0) == 0]
        if first:
            container["tool_calls"] = first
        else:
            del container["tool_calls"]


def apply_to_completion(obj, stops, single_tool_call):
    """Apply stop strings and the single-tool-call rule to a non-stream chat completion."""
    for choice in obj.get("choices") or []:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        if stops and isinstance(message.get("content"), str):
            message["content"], hit = cut_at_stop(message["content"], stops)
            if hit:
                choice["finish_reason"] = "stop"
        calls = message.get("tool_calls")
        if single_tool_call and isinstance(calls, list) and len(calls) > 1:
            message["tool_calls"] = calls[:1]
