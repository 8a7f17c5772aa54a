"""SSE framing and the stream rules Kiln owns, as plain functions (no HTTP): events split at any
byte, CR/CRLF framing, a leading byte-order mark, comment/``event:``/``id:``/``retry:`` lines and
event names (WHATWG HTML, "Server-sent events"), usage stripping and pricing in place, running
totals, stop strings and the single-tool-call rule."""
import json
from decimal import Decimal
from types import SimpleNamespace

import pytest

from gateway.backends.sse import (BOM, DONE, ErrorEvent, EventSplitter, frame, member_span,
                                  with_cost, without_member)
from gateway.billing import Usage
from gateway.backends.relay import StreamFailed
from gateway.dialects.chat import ChatStream
from gateway.flow.metering import Meter
from gateway.flow.outcomes import check_complete
from gateway.flow.rules import StreamRules

pytestmark = pytest.mark.unit

UNICODE = "caf\u00e9 \u2013 \u65e5\u672c \U0001F642"  # 2-, 3- and 4-byte UTF-8 characters
CHUNK = json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"content": UNICODE}, "finish_reason": None}]},
    ensure_ascii=False).encode()


class ChatRelay(StreamRules):
    """The stream rules as a chat client sees them: each payload kept is sent as its own event
    (:class:`gateway.dialects.chat.ChatStream`), and the stream's end."""

    stream = ChatStream(SimpleNamespace(include_usage=True))

    def apply(self, payload):
        kept = super().apply(payload)
        return None if kept is None else self.stream.chunk(*kept)

    def end(self, usage, cost_usd):
        return self.stream.end(usage, cost_usd, self)


def rules(stops=(), single_tool_call=False, cap=1000):
    return ChatRelay(Meter(cap), stops, single_tool_call)


def feed_pieces(pieces):
    splitter, out = EventSplitter(), []
    for piece in pieces:
        out += splitter.feed(piece)
    return out, splitter


# -- framing --------------------------------------------------------------------------------

@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_split_point_gives_the_same_events(newline):
    stream = b"".join(b"data: " + p + newline + newline for p in (CHUNK, b'{"x":1}', DONE))
    for cut in range(1, len(stream)):
        events, splitter = feed_pieces([stream[:cut], stream[cut:]])
        assert events == [CHUNK, b'{"x":1}', DONE], cut
        assert splitter.pending == b""


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_one_byte_at_a_time(newline):
    stream = b"data: " + CHUNK + newline + newline + b"data: [DONE]" + newline + newline
    events, _ = feed_pieces([stream[i:i + 1] for i in range(len(stream))])
    assert events == [CHUNK, DONE]


def test_event_is_released_as_soon_as_its_blank_line_arrives():
    """Also with CR framing, where the next byte could still make the CR a CRLF."""
    for end in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        splitter = EventSplitter()
        assert splitter.feed(b"data: {}" + end[:len(end) // 2]) == []
        assert splitter.feed(end[len(end) // 2:]) == [b"{}"]


def test_a_split_multibyte_character_is_decoded_whole():
    cut = CHUNK.index("\U0001F642".encode()) + 2  # inside the 4-byte emoji
    events, _ = feed_pieces([b"data: " + CHUNK[:cut], CHUNK[cut:] + b"\n", b"\n"])
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == UNICODE


def test_comments_event_id_retry_lines_are_dropped():
    stream = (b": ping\n\nretry: 3000\n\nevent: message\nid: 7\ndata: {\"a\":1}\n\n"
              b"data:{\"b\":2}\n: trailing comment\n\nevent: ping\n\n")
    events, _ = feed_pieces([stream])
    assert events == [b'{"a":1}', b'{"b":2}']


def test_multi_line_data_is_joined_with_newlines():
    events, _ = feed_pieces([b"data: {\"a\":\ndata: 1}\n\n"])
    assert events == [b'{"a":\n1}']


@pytest.mark.parametrize("cut", range(0, 5))
def test_a_leading_byte_order_mark_is_dropped_wherever_the_reads_split_it(cut):
    stream = BOM + b"data: {\"a\":1}\n\n"
    events, splitter = feed_pieces([stream[:cut], stream[cut:]] if cut else [stream])
    assert events == [b'{"a":1}'] and splitter.pending == b""
    bytewise, _ = feed_pieces([stream[i:i + 1] for i in range(len(stream))])
    assert bytewise == [b'{"a":1}']


def test_only_the_streams_first_byte_order_mark_is_dropped():
    """A second mark is the first line's field name (``\ufeffdata``, unknown: dropped); one
    after the start is the next line's; a stream's first bytes that only begin like one are
    its own."""
    events, _ = feed_pieces([BOM + BOM + b"data: 1\n\ndata: 2\n\n" + BOM + b"data: 3\n\n"])
    assert events == [b"2"]
    events, _ = feed_pieces([b"\xef", b"\xbbdata: 1\n\n"])
    assert events == []  # the bytes were never a mark: a field named "\xef\xbbdata"
    events, _ = feed_pieces([b"d", b"ata: 1\n\n"])
    assert events == [b"1"]


def test_only_message_events_are_chunks():
    stream = (b"event: message\ndata: 1\n\nevent:\ndata: 2\n\nevent\ndata: 3\n\n"
              b"event: ping\ndata: {}\n\nevent: response.output_text.delta\ndata: {}\n\n"
              b"event: ping\nevent: message\ndata: 4\n\ndata: 5\nevent: Message\n\n")
    events, _ = feed_pieces([stream])
    assert events == [b"1", b"2", b"3", b"4"]  # the last event line names it; names are exact


def test_an_error_event_is_returned_marked():
    events, _ = feed_pieces([b"event: error\ndata: {\"message\":\"overloaded\"}\n\n"
                            b"event: error\n\n"])  # no data: no event
    assert events == [b'{"message":"overloaded"}'] and isinstance(events[0], ErrorEvent)


def test_a_field_name_without_a_colon_has_an_empty_value():
    events, _ = feed_pieces([b"data\n\ndata\ndata\n\ndata:x\nid\nretry\n\n"])
    assert events == [b"", b"\n", b"x"]


@pytest.mark.parametrize("tail", [b"data: [DONE]", b"data:[DONE]\r\n",
                                  b"event: message\ndata: [DONE]"])
def test_a_done_without_its_blank_line_ends_the_stream_complete(tail):
    events, splitter = feed_pieces([b"data: {\"a\":1}\n\n" + tail])
    check_complete(rules(), splitter.pending)  # raises if not complete
    with pytest.raises(StreamFailed):
        check_complete(rules(), b'data: {"tru')


def test_unfinished_event_is_pending():
    events, splitter = feed_pieces([b"data: {\"a\":1}\n\ndata: {\"tru"])
    assert events == [b'{"a":1}'] and splitter.pending == b'data: {"tru'


# -- in-place edits -------------------------------------------------------------------------

def test_usage_member_is_removed_in_place():
    cases = {
        b'{"id": "c", "choices": [], "usage": null}': b'{"id": "c", "choices": []}',
        b'{"usage": null, "id": "c"}': b'{ "id": "c"}',
        b'{"id":"c","usage":{"prompt_tokens":3,"x":{"y":[1]}},"z":"\\u00e9"}':
            b'{"id":"c","z":"\\u00e9"}',
        b'{"usage":null}': b"{}",
    }
    for payload, expected in cases.items():
        assert without_member(payload, b"usage") == expected
        assert json.loads(expected) == {k: v for k, v in json.loads(payload).items()
                                        if k != "usage"}


def test_ambiguous_usage_is_not_edited_in_place():
    # The name twice, or only inside a string value: the caller re-serialises instead.
    assert member_span(b'{"usage":null,"x":{"usage":1}}', b"usage") is None
    assert member_span(b'{"content":"the \\"usage\\": null"}', b"usage") is None
    assert member_span(b'{"content":"say \\"usage"}', b"usage") is None


def test_cost_is_added_in_place_as_an_exact_decimal():
    payload = b'{"id":"c", "usage": {"prompt_tokens": 3, "completion_tokens": 1} }'
    out = with_cost(payload, Decimal("0.000000123"))
    assert out == (b'{"id":"c", "usage": {"prompt_tokens": 3, "completion_tokens": 1,'
                   b'"cost":0.000000123} }')
    assert with_cost(b'{"usage":{}}', Decimal("1.50")) == b'{"usage":{"cost":1.5}}'


# -- stream rules ---------------------------------------------------------------------------

def test_unchanged_chunks_leave_byte_for_byte():
    payload = (b'{"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, '
               b'"function": {"arguments": "{\\"city\\": \\"Par"}}]}, "finish_reason": null}]}')
    r = rules(stops=("STOP",))
    assert r.apply(payload) == frame(payload)
    assert r.apply(CHUNK) == frame(CHUNK)
    assert r.meter.deltas == 2


def test_null_usage_is_stripped_in_place():
    payload = b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "\\u00e9"}}], ' \
              b'"usage": null}'
    assert rules().apply(payload) == frame(b'{"id": "c", "choices": [{"index": 0, "delta": '
                                           b'{"content": "\\u00e9"}}]}')


def test_running_usage_on_a_chunk_with_choices_is_counted_and_stripped():
    payload = (b'{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
               b'"usage":{"prompt_tokens":10,"completion_tokens":2}}')
    r = rules()
    out = r.apply(payload)
    assert out == frame(b'{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
    assert r.meter.reported == {"prompt_tokens": 10, "completion_tokens": 2}


def test_the_usage_only_chunk_is_held_for_the_end():
    r = rules()
    usage_chunk = (b'{"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,'
                   b'"total_tokens":2}}')
    assert r.apply(usage_chunk) is None
    assert r.usage_payload == usage_chunk and r.meter.reported["prompt_tokens"] == 1
    # as sent, with only the cost added, when it says what is billed; else rewritten with
    # Kiln's counts
    assert r.end(Usage(prompt=1, completion=1), Decimal("0.5")) == frame(
        usage_chunk[:-2] + b',"cost":0.5}}') + frame(DONE)
    kiln = json.loads(r.end(Usage(prompt=3, completion=4), Decimal("0.01")).split(b"\n\n")[0][6:])
    assert kiln["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "cost": 0.01} and kiln["id"] == "c"


def test_running_totals_last_value_counts():
    r = rules()
    for n in (1, 2, 3):
        r.apply(json.dumps({"choices": [{"index": 0, "delta": {"content": "t"}}],
                            "usage": {"prompt_tokens": 10, "completion_tokens": n}}).encode())
    assert r.meter.reported == {"prompt_tokens": 10, "completion_tokens": 3}
    assert r.meter.deltas == 3 and r.meter.generated == 3


def test_error_frame_and_done_are_noted_not_relayed():
    r = rules()
    assert r.apply(DONE) is None and r.done
    assert r.apply(b'{"error":{"message":"oom"}}') is None
    assert r.error == {"message": "oom"}
    bare = rules()
    assert bare.apply(b'{"object":"error","message":"bad","code":400}') is None
    assert bare.error["message"] == "bad"


def test_an_error_event_is_the_backends_error():
    """``event: error`` (its JSON's ``error``, or the object itself): the stream's error; as the
    first event, before any token, a refusal (docs/METERING.md)."""
    r = rules()
    assert r.apply(ErrorEvent(b'{"error":{"message":"oom"}}')) is None
    assert r.error == {"message": "oom"} and r.meter.refused
    later = rules()
    assert later.apply(CHUNK) is not None
    assert later.apply(ErrorEvent(b'{"type":"error","message":"gone"}')) is None
    assert later.error["message"] == "gone" and not later.meter.refused
    text = rules()
    assert text.apply(ErrorEvent(b"<html>bad gateway</html>")) is None
    assert text.error == {"message": "the model backend sent an error event"}


def test_an_empty_message_event_carries_nothing():
    r = rules()
    assert r.apply(b"") is None and r.apply(b"\n") is None and r.error is None


def test_a_chunk_in_several_data_lines_reaches_the_client_as_one():
    splitter = EventSplitter()
    payloads = splitter.feed(b'data: {"id":"c1","choices":[{"index":0,\r\n'
                             b'data: "delta":{"content":"a\\nb"}}]}\r\n\r\n')
    r = rules()
    out = r.apply(payloads[0])
    assert out.count(b"data:") == 1 and out.endswith(b"\n\n") and b"\n" not in out[:-2]
    assert json.loads(out[6:])["choices"][0]["delta"]["content"] == "a\nb"
    assert out == b'data: {"id":"c1","choices":[{"index":0, "delta":{"content":"a\\nb"}}]}\n\n'


def test_n_choices_are_all_relayed_and_metered():
    payload = (b'{"choices":[{"index":0,"delta":{"content":"a"}},'
               b'{"index":1,"delta":{"content":"b"},"finish_reason":"length"}]}')
    r = rules()
    assert r.apply(payload) == frame(payload)
    assert r.meter.deltas == 2 and r.meter.finished == {1} and not r.finished


def test_stop_string_split_across_chunks_is_enforced():
    r = rules(stops=("END",))
    outs = [r.apply(json.dumps({"choices": [{"index": 0, "delta": {"content": t}}]}).encode())
            for t in ("abc E", "N", "Dxyz", "more")]
    texts = [json.loads(o[6:])["choices"][0]["delta"]["content"] if o else None for o in outs]
    assert texts == ["abc ", "", "", None]
    assert json.loads(outs[2][6:])["choices"][0]["finish_reason"] == "stop"
    assert r.finished  # the only choice was ended at its stop string


def test_held_back_text_is_released_at_the_finish():
    r = rules(stops=("END",))
    r.apply(b'{"choices":[{"index":0,"delta":{"content":"x E"}}]}')
    out = r.apply(b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
    assert json.loads(out[6:])["choices"][0]["delta"]["content"] == "E"


def test_single_tool_call_rule_rewrites_only_when_needed():
    r = rules(single_tool_call=True)
    first = b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a"}]}}]}'
    assert r.apply(first) == frame(first)
    out = r.apply(b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0},{"index":1}]}}]}')
    assert json.loads(out[6:])["choices"][0]["delta"]["tool_calls"] == [{"index": 0}]


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b'"text"'])
def test_data_that_is_not_a_json_object_fails_the_stream(payload):
    r = rules()
    assert r.apply(payload) is None and r.error is not None


def test_the_budget_stops_the_chunk_that_would_pass_it():
    r = rules(cap=2)
    chunk = b'{"id":"c","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"t"}}]}'
    assert r.apply(chunk) and r.apply(chunk)
    assert r.apply(chunk) is None and r.cut and r.meter.deltas == 2
    end = json.loads(r.end(Usage(), Decimal(0)).split(b"\n\n")[0][6:])
    assert end["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    assert (end["id"], end["model"]) == ("c", "m")


def test_a_running_count_past_the_budget_also_stops_it():
    r = rules(cap=10)
    ok = {"choices": [{"index": 0, "delta": {"content": "t"}}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 10}}
    assert r.apply(json.dumps(ok).encode())
    ok["usage"]["completion_tokens"] = 11
    assert r.apply(json.dumps(ok).encode()) is None and r.cut


def test_everything_generated_is_counted():
    r = rules()
    chunks = [{"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"name": "f", "arguments": "{\"a\":"}}]}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
              {"choices": [{"index": 1, "delta": {"refusal": "no"}}]}]
    for chunk in chunks:
        r.apply(json.dumps(chunk).encode())
    assert r.meter.text() == "Helf{\"a\":hmno" and r.meter.deltas == 4


def tool_fragment(index, call_id=None, name=None, arguments=""):
    call = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
                      ).encode()


def relayed_calls(frames):
    """``[(index, id or None, arguments)]`` of the tool-call fragments a client was sent."""
    out = []
    for framed in frames:
        if framed is None:
            continue
        for call in json.loads(framed[6:])["choices"][0]["delta"].get("tool_calls", []):
            out.append((call["index"], call.get("id"), call["function"]["arguments"]))
    return out


# Two calls, each at index 0 with its own id: the numbering some servers use.
ALL_AT_ZERO = [tool_fragment(0, "call_a", "get_weather"), tool_fragment(0, arguments='{"c":'),
               tool_fragment(0, arguments='"Oslo"}'), tool_fragment(0, "call_b", "get_time"),
               tool_fragment(0, arguments="{}")]


def test_a_new_tool_call_id_at_a_used_index_is_a_new_call_for_the_client():
    r = rules()
    sent = relayed_calls(r.apply(p) for p in ALL_AT_ZERO)
    assert sent == [(0, "call_a", ""), (0, None, '{"c":'), (0, None, '"Oslo"}'),
                    (1, "call_b", ""), (1, None, "{}")]


def test_one_tool_call_only_keeps_the_first_of_calls_all_numbered_zero():
    r = rules(single_tool_call=True)
    sent = relayed_calls(r.apply(p) for p in ALL_AT_ZERO)
    assert sent == [(0, "call_a", ""), (0, None, '{"c":'), (0, None, '"Oslo"}')]


def test_numbered_tool_calls_leave_byte_for_byte():
    r = rules()
    numbered = [tool_fragment(0, "call_a", "f"), tool_fragment(0, arguments="{}"),
                tool_fragment(1, "call_b", "g"), tool_fragment(1, arguments="{}")]
    assert [r.apply(p) for p in numbered] == [frame(p) for p in numbered]


@pytest.mark.parametrize("payload", [
    b'{"choices":[{"delta":{"content":"h\\u00e9"},"index":0}],"n":1.5e-3}',
    b'{"logprob":NaN,"top":-Infinity}',           # Python's json reads them; orjson does not
    b'{"id":123456789012345678901234567890}',     # past 64 bits
    b'{"text":"\\ud800 lone surrogate"}',
    '{"text":"caf\u00e9"}'.encode("utf-16"),      # not UTF-8
])
def test_loads_reads_every_payload_as_the_standard_library_does(payload):
    import json
    from gateway.backends.sse import loads
    expected = json.loads(payload)
    got = loads(payload)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)


def test_loads_refuses_what_is_not_json():
    from gateway.backends.sse import loads
    with pytest.raises(ValueError):
        loads(b'{"a": ')


@pytest.mark.parametrize("obj", [
    {"id": "c", "choices": [{"text": "caf\u00e9 \U0001f600", "logprob": -0.25}], "n": 1e-05},
    {"text": "lone \ud800 surrogate"},          # orjson refuses it: the standard library writes it
    {"big": 2 ** 70},                          # past 64 bits: the standard library again
])
def test_dumps_writes_what_it_is_given_with_the_exact_cost(obj):
    from gateway.backends.sse import dumps
    obj = {**obj, "usage": {"prompt_tokens": 3}}
    cost = Decimal("0.000000123456789")
    expected = {k: v for k, v in json.loads(json.dumps(obj)).items() if k != "usage"}
    text = dumps(obj, cost)
    assert b'"usage":{"prompt_tokens":3,' in text  # compact: no space after a separator
    assert b'"cost":0.000000123456789' in text
    read = json.loads(text, parse_float=Decimal)
    assert read["usage"]["cost"] == cost
    assert {k: v for k, v in json.loads(text).items() if k != "usage"} == expected


def test_dumps_writes_a_non_finite_float_as_null_json_having_no_literal_for_it():
    from gateway.backends.sse import dumps
    assert json.loads(dumps({"logprob": float("nan")})) == {"logprob": None}


def test_a_stored_response_keeps_its_decimal_cost_exact_whoever_writes_it():
    from gateway.ledger.responses import _loads, dumps
    for extra in ("", "\ud800"):
        obj = {"output_text": "hi" + extra, "usage": {"cost": Decimal("0.1000000001")}}
        assert _loads(dumps(obj)) == obj
