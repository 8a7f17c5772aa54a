"""Property of the SSE splitter (gateway/backends/sse.py): any split of any valid stream yields the
same events. Streams are drawn from the SSE grammar (WHATWG HTML, "Server-sent events"): an
optional leading byte-order mark, events of one or more ``data:`` lines (with or without the
space after the colon, or a bare ``data`` field: an empty value), comment, ``id:`` and
``retry:`` lines and bare field names, ``event:`` names (none, empty or ``message``: a chat
chunk; ``error``: the backend's error; any other: dropped), any line ending (LF, CRLF, CR,
mixed), payloads of any bytes but CR and LF, multi-byte UTF-8 included. And what the client
gets of chunks written over several data lines: one ``data:`` line each, the same JSON."""
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends.sse import BOM, ErrorEvent, EventSplitter
from gateway.dialects.chat import ChatStream
from gateway.flow.metering import Meter
from gateway.flow.rules import StreamRules

pytestmark = pytest.mark.unit
NEWLINE = st.sampled_from([b"\n", b"\r\n", b"\r"])
TEXT = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]),
               max_size=40).map(lambda text: text.encode())
OTHER_LINE = st.one_of(TEXT.map(lambda t: b":" + t), TEXT.map(lambda t: b"id: " + t),
                       st.just(b"retry: 1000"), st.sampled_from([b"id", b"retry", b"foo"]))
NAME = st.one_of(st.sampled_from([b"", b"message", b"error", b"ping", b"response.completed"]),
                 TEXT)


def field_line(draw, field, value):
    """A line giving ``field`` the ``value``: with or without the space after the colon, or
    the bare field name when the value is empty."""
    if not value and draw(st.booleans()):
        return field
    if value.startswith(b" ") or draw(st.booleans()):
        return field + b": " + value  # the one space after the colon is not the value's
    return field + b":" + value


@st.composite
def data_line(draw):
    """``(line, value)``: a data line and the value it carries."""
    value = draw(TEXT)
    return field_line(draw, b"data", value), value


@st.composite
def event(draw):
    """``(lines, payload)``: an event's lines in order, and what the splitter returns for it:
    its data (an :class:`ErrorEvent` when named ``error``), or None (no data, another name)."""
    data = draw(st.lists(data_line(), max_size=3))
    lines = [line for line, _ in data]
    names, at = draw(st.lists(NAME, max_size=2)), 0
    for name in names:  # anywhere, in their order: the last one names the event
        at = draw(st.integers(at, len(lines)))
        lines.insert(at, field_line(draw, b"event", name))
        at += 1
    for other in draw(st.lists(OTHER_LINE, max_size=2)):
        lines.insert(draw(st.integers(0, len(lines))), other)
    if not lines:
        lines = [b": keepalive"]
    payload = b"\n".join(value for _, value in data) if data else None
    name = names[-1] if names else b""
    if payload is not None and name == b"error":
        payload = ErrorEvent(payload)
    elif name not in (b"", b"message"):
        payload = None
    return lines, payload


@st.composite
def stream(draw):
    """``(bytes, payloads)``: a whole stream and the payloads its events carry, in order."""
    events = draw(st.lists(event(), min_size=1, max_size=8))
    out = bytearray(BOM if draw(st.booleans()) else b"")
    for lines, _ in events:
        for line in [*lines, b""]:  # the blank line ends the event
            out += line + _newline(draw, out)
    return bytes(out), [payload for _, payload in events if payload is not None]


def _newline(draw, before):
    """A line ending; after a CR, not a lone LF (CR then LF is one CRLF ending)."""
    newline = draw(NEWLINE)
    return b"\r" if before.endswith(b"\r") and newline == b"\n" else newline


def typed(payloads):
    """Payloads with their kind, so that an error event never passes for a chunk."""
    return [(type(p) is ErrorEvent, bytes(p)) for p in payloads]


def split_at(data, cuts):
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=500, deadline=None)
@given(drawn=stream(), cuts=st.lists(st.integers(min_value=0), max_size=30))
def test_any_split_of_any_valid_stream_yields_the_same_events(drawn, cuts):
    data, payloads = drawn
    splitter, events = EventSplitter(), []
    for piece in split_at(data, cuts):
        events += splitter.feed(piece)
    assert typed(events) == typed(payloads)
    assert splitter.pending == b""


@settings(max_examples=200, deadline=None)
@given(drawn=stream())
def test_one_byte_at_a_time_yields_the_same_events(drawn):
    data, payloads = drawn
    splitter, events = EventSplitter(), []
    for i in range(len(data)):
        events += splitter.feed(data[i:i + 1])
    assert typed(events) == typed(payloads)


CONTENT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=20)


@settings(max_examples=200, deadline=None)
@given(contents=st.lists(CONTENT, min_size=1, max_size=5), indent=st.sampled_from([None, 0, 2]),
       newline=NEWLINE, cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_each_chunk_reaches_the_client_on_one_data_line(contents, indent, newline, cuts):
    """Chunks a server writes over several data lines (pretty-printed JSON, one data line per
    line) leave Kiln as OpenAI's: one ``data:`` line each, the same JSON."""
    chunks = [{"id": "c1", "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]}
              for c in contents]
    data = b"".join(b"".join(b"data: " + line + newline
                             for line in json.dumps(chunk, indent=indent).encode().split(b"\n"))
                    + newline for chunk in chunks)
    splitter, rules = EventSplitter(), StreamRules(Meter(10_000), (), False)
    stream, out = ChatStream(SimpleNamespace(include_usage=False)), b""
    for piece in split_at(data, cuts):
        for payload in splitter.feed(piece):
            kept = rules.apply(payload)
            out += stream.chunk(*kept) if kept else b""
    frames = out.split(b"\n\n")
    assert frames[-1] == b"" and len(frames) == len(chunks) + 1
    for frame, chunk in zip(frames, chunks, strict=False):
        assert frame.startswith(b"data: ") and b"\n" not in frame
        assert json.loads(frame[6:]) == chunk
