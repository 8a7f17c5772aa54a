"""Server-sent events: framing on bytes, and editing a chunk's JSON in place.

Events are split on blank lines while still bytes and decoded only whole, so a chunk boundary
inside a multi-byte character or between the two newlines that end an event changes nothing.
Each event's lines are read as the standard reads them (WHATWG HTML, "Server-sent events",
"Interpreting an event stream"): one leading byte-order mark is dropped; a line is a comment
(``:``), ``field: value`` (one space after the colon is not the value's) or a bare field name
(an empty value); the ``data`` lines of an event are joined with newlines; the last ``event``
line names it (none, or an empty name, is ``message``); ``id``, ``retry`` and unknown fields
are dropped; an event with no ``data`` line is nothing. Only ``message`` events are chat
chunks; an ``error`` event is returned marked (:class:`ErrorEvent`: the backend's error,
docs/RELIABILITY.md, "Streams from every real server"); events of any other name are dropped.
:func:`without_member` and :func:`with_cost` edit a payload's bytes in place, so that
every other field keeps its exact bytes; the rules that decide what to change are the flow's
(:mod:`gateway.flow.rules`).
"""
import json

import orjson

DONE = b"[DONE]"
BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark: one, at the very start, is not the stream's
MESSAGE, ERROR = b"message", b"error"
KEEPALIVE = b": keepalive\n\n"
_COST_MARK = "\x00kiln-cost\x00"
_DECODER = json.JSONDecoder()
# A run of 20 digits, found by mapping every digit to "0" (a C pass, unlike a regex's scan).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_TWENTY_DIGITS = b"0" * 20
_WS = b" \t\r\n"


class EventTooLarge(ValueError):
    """An event grew past the splitter's limit before it ended. :attr:`events`: the complete
    events' payloads that came before it in the same read (still the backend's to relay)."""

    def __init__(self, message, events=()):
        super().__init__(message)
        self.events = events


class ErrorEvent(bytes):
    """The ``data`` of an event named ``error`` (``event: error``): the backend's error, not a
    chunk."""


class EventSplitter:
    """Accumulate bytes and return whole events' ``data`` payloads, in linear time.

    Lines may end in LF, CRLF or CR (the SSE grammar allows all three), also mixed, and a CRLF
    may be split between two reads, as may the byte-order mark. Only the bytes after the last
    event are kept, and each read is searched once: an event arriving in many small reads costs
    no more than one, and each event's lines are read once.

    :param max_event_bytes: an unfinished event longer than this raises :class:`EventTooLarge`.
    """

    def __init__(self, max_event_bytes=None):
        self._buf = bytearray()
        self._after_cr = False  # the last read ended in CR: a leading LF is the rest of a CRLF
        self._head = b""  # the first bytes while they may be a byte-order mark; then False
        self.max_event_bytes = max_event_bytes

    def feed(self, data):
        """Add ``data``; return the list of complete events' payloads (bytes) now available:
        ``message`` events' data, and ``error`` events' as :class:`ErrorEvent`.

        Events with no ``data`` line (comments, keepalives, ``retry:``) and events of any other
        name yield nothing.

        :raises EventTooLarge: the unfinished event passed ``max_event_bytes``.
        """
        if not data:
            return []
        if self._head is not False:
            data = self._strip_bom(data)
            if not data:
                return []
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
            events = [p for p in map(_payload, head.split(b"\n\n")) if p is not None]
        if self.max_event_bytes is not None and len(self._buf) > self.max_event_bytes:
            raise EventTooLarge(f"The model backend sent an event longer than "
                                f"{self.max_event_bytes} bytes.", events)
        return events

    def _strip_bom(self, data):
        """Return ``data`` without the stream's leading byte-order mark; hold the first bytes
        back while they are still a beginning of one."""
        data = self._head + data
        if len(data) < len(BOM) and BOM.startswith(data):
            self._head = data
            return b""
        self._head = False  # decided: the stream's start is behind
        return data[len(BOM):] if data.startswith(BOM) else data

    @property
    def pending(self):
        """Bytes of an unfinished event (non-empty when a stream was cut mid-event)."""
        return (bytes(self._head or b"") + bytes(self._buf)).strip()


def loads(payload):
    """The JSON value of a backend's ``payload`` (bytes: one event's data or a whole reply;
    text is read by the standard library).

    orjson parses a chunk about five times faster than the standard library (bench/RESULTS.md);
    what it refuses and the standard library reads (``NaN``, ``Infinity``, text not in UTF-8),
    and a payload with a run of 20 digits (orjson reads an integer past 64 bits as a float, the
    standard library as the integer it is), are read by the standard library, so that Kiln
    reads every payload as before.

    :raises ValueError: not JSON.
    """
    if isinstance(payload, bytes) and _TWENTY_DIGITS not in payload.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            pass
    return json.loads(payload)


def unfinished_payload(pending):
    """Return what the unfinished event ``pending`` (:attr:`EventSplitter.pending`) would carry
    had its blank line come: a stream cut just before it may still have said ``[DONE]``."""
    return _payload(pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))


def _payload(event):
    """Return the payload of one event's lines (LF-separated, no blank line): the ``data`` of
    a ``message`` event, an :class:`ErrorEvent` for an ``error`` event, else None."""
    if event.startswith(b"data:") and b"\n" not in event:  # the common one-line event
        return event[6:] if event[5:6] == b" " else event[5:]
    name, lines = b"", []
    for line in event.split(b"\n"):
        field, _, value = line.partition(b":")
        if not field:
            continue  # a comment (or nothing)
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            lines.append(value)
        elif field == b"event":
            name = value
    if not lines:
        return None
    data = b"\n".join(lines)
    if name in (b"", MESSAGE):
        return data
    return ErrorEvent(data) if name == ERROR else None


def frame(payload):
    """Return ``payload`` framed as one SSE data event."""
    return b"data: " + payload + b"\n\n"


def _cost_literal(cost_usd):
    # JSON has no decimal type; write a plain decimal literal, never through a binary float.
    return format(cost_usd.normalize(), "f")


def dumps(obj, cost_usd=None):
    """Serialise ``obj`` compactly as UTF-8; with ``cost_usd`` (Decimal) set ``usage.cost``
    exactly. Text that UTF-8 cannot carry (a lone surrogate, from a ``\\ud800`` escape) is
    written as a JSON escape, intact.

    orjson writes it (several times faster than the standard library, an embedding's floats
    most of all; a float as the shortest text that reads back as it, like ``repr``, and a
    non-finite one, which JSON has no literal for, as ``null``); what orjson refuses (a lone
    surrogate, an integer past 64 bits, a key that is not a string) is written by the standard
    library, as before.
    """
    if cost_usd is not None:
        obj["usage"]["cost"] = orjson.Fragment(_cost_literal(cost_usd).encode())
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError is one
        pass
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
