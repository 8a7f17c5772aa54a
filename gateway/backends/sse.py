"""Server-sent events: framing on bytes, and the per-event rules Kiln owns in a stream.

Events are split on blank lines while still bytes and decoded only whole, so a chunk boundary
inside a multi-byte character or between the two newlines that end an event changes nothing
(WHATWG HTML, "Server-sent events"). Comment, ``event:``, ``id:`` and ``retry:`` lines are
dropped. A chunk that Kiln does not need to change leaves with its ``data`` payload unchanged,
byte for byte; Kiln changes only usage (strip it, or write the billed one with ``cost``), stop
strings, and the single-tool-call rule. Usage is stripped or priced by editing the payload bytes
in place where it can, so every other field keeps its exact bytes; a stop cut, a dropped tool
call or a usage Kiln corrected re-serialises the chunk.
"""
import json

DONE = b"[DONE]"
KEEPALIVE = b": keepalive\n\n"
_COST_MARK = "\x00kiln-cost\x00"
_DECODER = json.JSONDecoder()
_WS = b" \t\r\n"


class EventTooLarge(ValueError):
    """An event grew past the splitter's limit before it ended."""


class EventSplitter:
    """Accumulate bytes and return whole events' ``data`` payloads, in linear time.

    Lines may end in LF, CRLF or CR (the SSE grammar allows all three), also mixed, and a CRLF
    may be split between two reads. Only the bytes after the last event are kept, and each read
    is searched once: an event arriving in many small reads costs no more than one.

    :param max_event_bytes: an unfinished event longer than this raises :class:`EventTooLarge`.
    """

    def __init__(self, max_event_bytes=None):
        self._buf = bytearray()
        self._after_cr = False  # the last read ended in CR: a leading LF is the rest of a CRLF
        self.max_event_bytes = max_event_bytes

    def feed(self, data):
        """Add ``data``; return the list of complete data payloads (bytes) now available.

        Events with no ``data`` line (comments, keepalives, ``retry:``) yield nothing.

        :raises EventTooLarge: the unfinished event passed ``max_event_bytes``.
        """
        if self._after_cr and data[:1] == b"\n":
            data = data[1:]
        self._after_cr = data[-1:] == b"\r"
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        search_from = max(0, len(self._buf) - 1)
        self._buf += data
        end = self._buf.rfind(b"\n\n", search_from)
        events = []
        if end >= 0:
            head = bytes(self._buf[:end])
            del self._buf[:end + 2]
            events = [p for p in map(_data_payload, head.split(b"\n\n")) if p is not None]
        if self.max_event_bytes is not None and len(self._buf) > self.max_event_bytes:
            raise EventTooLarge(f"The model backend sent an event longer than "
                                f"{self.max_event_bytes} bytes.")
        return events

    @property
    def pending(self):
        """Bytes of an unfinished event (non-empty when a stream was cut mid-event)."""
        return bytes(self._buf).strip()


def _data_payload(event):
    if event.startswith(b"data:") and b"\n" not in event:
        return event[6:] if event[5:6] == b" " else event[5:]
    lines = [line[6:] if line[5:6] == b" " else line[5:]
             for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def frame(payload):
    """Return ``payload`` framed as one SSE data event."""
    return b"data: " + payload + b"\n\n"


def _cost_literal(cost_usd):
    # JSON has no decimal type; write a plain decimal literal, never through a binary float.
    return format(cost_usd.normalize(), "f")


def dumps(obj, cost_usd=None):
    """Serialise ``obj`` compactly as UTF-8; with ``cost_usd`` (Decimal) set ``usage.cost``
    exactly. Text that UTF-8 cannot carry (a lone surrogate, from a ``\\ud800`` escape) is
    written as a JSON escape, intact."""
    if cost_usd is not None:
        obj["usage"]["cost"] = _COST_MARK
    try:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        text = json.dumps(obj, separators=(",", ":")).encode()
    if cost_usd is not None:
        text = text.replace(json.dumps(_COST_MARK).encode(), _cost_literal(cost_usd).encode())
    return text


def member_span(payload, key):
    """Locate the top-level member ``key`` of the JSON object ``payload`` (bytes), in place.

    :param key: bytes, an ASCII member name.
    :returns: ``(member start, value start, value end)`` byte offsets, or None when the name
        occurs other than exactly once (then the caller re-serialises instead).
    """
    needle = b'"' + key + b'"'
    start = payload.find(needle)
    if start < 0 or payload.find(needle, start + 1) >= 0:
        return None
    if payload[:start].rstrip(_WS)[-1:] not in (b"{", b","):
        return None  # the name is inside a string, not a member name
    rest = payload[start + len(needle):].lstrip(_WS)
    if rest[:1] != b":":
        return None
    value_start = len(payload) - len(rest[1:].lstrip(_WS))
    if payload.startswith(b"null", value_start):
        return start, value_start, value_start + 4
    try:
        tail = payload[value_start:].decode()
        _, end = _DECODER.raw_decode(tail)
    except ValueError:
        return None
    return start, value_start, value_start + len(tail[:end].encode())


def without_member(payload, key):
    """Return ``payload`` with top-level member ``key`` removed, other bytes unchanged (or None)."""
    span = member_span(payload, key)
    if span is None:
        return None
    start, _, end = span
    after = len(payload) - len(payload[end:].lstrip(_WS))
    if payload[after:after + 1] == b",":
        return payload[:start] + payload[after + 1:]
    before = len(payload[:start].rstrip(_WS)) - 1
    if payload[before:before + 1] == b",":
        return payload[:before] + payload[end:]
    return payload[:start] + payload[end:]


def with_cost(payload, cost_usd):
    """Return ``payload`` with ``"cost": cost_usd`` added to its ``usage`` object (or None)."""
    span = member_span(payload, b"usage")
    if span is None or payload[span[1]:span[1] + 1] != b"{":
        return None
    _, value_start, end = span
    close = end - 1
    sep = b"," if payload[value_start + 1:close].strip(_WS) else b""
    return payload[:close] + sep + b'"cost":' + _cost_literal(cost_usd).encode() + payload[close:]


class StopCutter:
    """Cut generated text before the first stop string, across chunk boundaries.

    Model servers may generate past ``stop``; Kiln enforces it (README, "Request contract").
    Text that could be the start of a stop string is held back until the next delta decides.
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
    """Apply Kiln's rules to each backend data payload of a chat stream, counting it.

    One ``json.loads`` per event; a chunk keeps its exact bytes unless Kiln changes it (a stop
    cut, a dropped tool call, a usage member removed). Usage is Kiln's to tell: a usage-only
    chunk is held and written at the end with the billed usage (:meth:`usage_frame`); a running
    usage member on a chunk with choices is removed.

    :param meter: :class:`gateway.flow.metering.Meter`; a chunk past its budget is not relayed and
        sets :attr:`cut`.
    :param stops: stop strings to enforce (may be empty).
    :param single_tool_call: keep only the first tool call (``index`` 0).
    """

    def __init__(self, meter, stops, single_tool_call):
        self.meter = meter
        self.cutter = StopCutter(stops) if stops else None
        self.single_tool_call = single_tool_call
        self.usage_payload = None  # the backend's usage-only chunk, held for the end
        self.indexes = set()       # choice indexes seen
        self.done = False          # the backend sent [DONE]
        self.error = None          # an error frame inside the stream, or a malformed event
        self.chunk_id, self.created, self.model = None, 0, None  # for chunks Kiln writes

    @property
    def cut(self):
        """Kiln stopped the generation at its budget."""
        return self.meter.cut

    def _ended(self):
        return self.meter.finished | (self.cutter.finished if self.cutter else set())

    @property
    def finished(self):
        """Every choice seen carried a finish_reason (or was ended at a stop string)."""
        return bool(self.indexes) and self.indexes <= self._ended()

    def apply(self, payload):
        """Return the framed bytes to send for ``payload``, or None to send nothing."""
        if payload == DONE:
            self.done = True
            return None
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.error = {"message": "the model backend sent an event that is not a JSON object"}
            return None
        if ("error" in obj or obj.get("object") == "error") and not obj.get("choices"):
            # {"error": {...}} (vLLM, SGLang, llama.cpp) or a bare {"object": "error", ...}
            self.error = obj.get("error") or obj
            return None
        if self.chunk_id is None:
            self.chunk_id, self.created, self.model = (obj.get("id"), obj.get("created"),
                                                       obj.get("model"))
        if not self.meter.admit_chunk(obj):
            return None  # past the budget: the caller ends the stream
        return self._apply(obj, payload)

    def _apply(self, obj, payload):
        choices = obj.get("choices")
        if not choices:
            if obj.get("usage") is not None:
                self.usage_payload = payload
                return None
            return frame(payload)
        rewritten = False
        if isinstance(choices, list):
            self.indexes.update(c.get("index", 0) for c in choices if isinstance(c, dict))
            if self.cutter or self.single_tool_call:
                rewritten = self._rewrite(obj, choices)
                if not obj["choices"]:
                    return None  # every choice of this chunk was already ended at a stop string
        if "usage" in obj:  # running usage, asked for by Kiln: not the client's
            stripped = None if rewritten else without_member(payload, b"usage")
            if stripped is not None:
                return frame(stripped)
            del obj["usage"]
            rewritten = True
        return frame(dumps(obj)) if rewritten else frame(payload)

    def length_frame(self):
        """Return the chunk that ends every unfinished choice with ``finish_reason: "length"``
        (Kiln stopped the generation at its budget)."""
        indexes = sorted(self.indexes - self._ended()) or [0]
        chunk = {"id": self.chunk_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model,
                 "choices": [{"index": i, "delta": {}, "finish_reason": "length"}
                             for i in indexes]}
        return frame(dumps(chunk))

    def usage_frame(self, usage, cost_usd, as_sent):
        """Return the usage chunk the client asked for: ``usage`` (an OpenAI usage dict, the
        billed counts) with ``cost``.

        :param as_sent: the backend's usage chunk already says ``usage``: relay its bytes with
            only ``cost`` added.
        """
        if as_sent and self.usage_payload is not None:
            priced = with_cost(self.usage_payload, cost_usd)
            if priced is not None:
                return frame(priced)
        chunk = json.loads(self.usage_payload) if self.usage_payload is not None else None
        if not isinstance(chunk, dict):
            chunk = {"id": self.chunk_id, "object": "chat.completion.chunk",
                     "created": self.created, "model": self.model, "choices": []}
        chunk["usage"] = dict(usage)
        return frame(dumps(chunk, cost_usd))

    def _rewrite(self, obj, choices):
        """Apply stop strings and the single-tool-call rule; return whether anything changed."""
        changed, kept = False, []
        for choice in choices:
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            index = choice.get("index", 0)
            if self.cutter and index in self.cutter.finished:
                changed = True
                continue  # Kiln already ended this choice at a stop string
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if self.cutter:
                    changed |= self._cut(choice, delta, index)
                if self.single_tool_call:
                    changed |= _first_tool_call_only(delta)
            kept.append(choice)
        if changed:
            obj["choices"] = kept
        return changed

    def _cut(self, choice, delta, index):
        changed = False
        content = delta.get("content")
        if isinstance(content, str) and content:
            text, hit = self.cutter.feed(index, content)
            if hit:
                delta["content"], choice["finish_reason"] = text, "stop"
                return True
            if text != content:
                delta["content"], changed = text, True
        if choice.get("finish_reason"):
            rest = self.cutter.flush(index)
            if rest:
                delta["content"], changed = (delta.get("content") or "") + rest, True
        return changed


def _first_tool_call_only(container):
    """Keep only the tool call of ``index`` 0; return whether ``container`` changed."""
    calls = container.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return False
    first = [c for c in calls if isinstance(c, dict) and c.get("index", 0) == 0]
    if len(first) == len(calls):
        return False
    if first:
        container["tool_calls"] = first
    else:
        del container["tool_calls"]
    return True


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
