"""SSE framing and the stream rules Kiln owns, as plain functions (no HTTP): events split at any
byte, CR/CRLF framing, comment/``event:``/``retry:`` lines, usage stripping and pricing in place,
running totals, stop strings and the single-tool-call rule."""
import json
from decimal import Decimal

import pytest

from gateway.sse import DONE, EventSplitter, StreamRules, frame, member_span, with_cost, \
    without_member

UNICODE = "caf\u00e9 \u2013 \u65e5\u672c \U0001F642"  # 2-, 3- and 4-byte UTF-8 characters
CHUNK = json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"content": UNICODE}, "finish_reason": None}]},
    ensure_ascii=False).encode()


def price(usage):
    return Decimal(usage.get("prompt_tokens", 0)) / 1000 + Decimal(
        usage.get("completion_tokens", 0)) / 100


def rules(include_usage=False, stops=(), single_tool_call=False):
    return StreamRules(include_usage, stops, single_tool_call, price)


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
    assert r.deltas == 2


def test_null_usage_is_stripped_in_place_when_not_asked():
    payload = b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "\\u00e9"}}], ' \
              b'"usage": null}'
    out = rules().apply(payload)
    assert out == frame(b'{"id": "c", "choices": [{"index": 0, "delta": {"content": '
                        b'"\\u00e9"}}]}')


def test_null_usage_is_kept_when_asked():
    payload = b'{"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],"usage":null}'
    assert rules(include_usage=True).apply(payload) == frame(payload)


def test_usage_on_a_chunk_with_choices_counts_and_is_priced_or_stripped():
    payload = (b'{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
               b'"usage":{"prompt_tokens":10,"completion_tokens":2}}')
    asked = rules(include_usage=True)
    out = asked.apply(payload)
    assert out == frame(payload[:-2] + b',"cost":0.03}}')
    assert asked.usage == {"prompt_tokens": 10, "completion_tokens": 2}
    not_asked = rules()
    out = not_asked.apply(payload)
    assert b"usage" not in out and json.loads(out[6:])["choices"][0]["finish_reason"] == "stop"
    assert not_asked.usage == {"prompt_tokens": 10, "completion_tokens": 2}


def test_usage_only_chunk_is_dropped_when_not_asked():
    r = rules()
    assert r.apply(b'{"id":"c","choices":[],"usage":{"prompt_tokens":1,'
                   b'"completion_tokens":1}}') is None
    assert r.usage["prompt_tokens"] == 1


def test_running_totals_last_value_counts():
    r = rules(include_usage=True)
    for n in (1, 2, 3):
        r.apply(json.dumps({"choices": [{"index": 0, "delta": {"content": "t"}}],
                            "usage": {"prompt_tokens": 10, "completion_tokens": n}}).encode())
    assert r.usage == {"prompt_tokens": 10, "completion_tokens": 3}
    assert r.deltas == 3


def test_error_frame_and_done_are_noted_not_relayed():
    r = rules()
    assert r.apply(DONE) is None and r.done
    assert r.apply(b'{"error":{"message":"oom"}}') is None
    assert r.error == {"message": "oom"}
    bare = rules()
    assert bare.apply(b'{"object":"error","message":"bad","code":400}') is None
    assert bare.error["message"] == "bad"


def test_n_choices_are_all_relayed_and_metered():
    payload = (b'{"choices":[{"index":0,"delta":{"content":"a"}},'
               b'{"index":1,"delta":{"content":"b"},"finish_reason":"length"}]}')
    r = rules()
    assert r.apply(payload) == frame(payload)
    assert r.deltas == 2 and r.finished == {1}


def test_stop_string_split_across_chunks_is_enforced():
    r = rules(stops=("END",))
    outs = [r.apply(json.dumps({"choices": [{"index": 0, "delta": {"content": t}}]}).encode())
            for t in ("abc E", "N", "Dxyz", "more")]
    texts = [json.loads(o[6:])["choices"][0]["delta"]["content"] if o else None for o in outs]
    assert texts == ["abc ", "", "", None]
    assert json.loads(outs[2][6:])["choices"][0]["finish_reason"] == "stop"


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


def test_non_json_data_is_relayed_as_is():
    assert rules().apply(b"not json") == frame(b"not json")


def test_generated_text_is_collected_for_exact_counting_when_asked():
    rules = StreamRules(False, (), False, lambda usage: 0, collect_text=True)
    chunks = [{"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"name": "f", "arguments": "{\"a\":"}}]}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}]
    for chunk in chunks:
        rules.apply(json.dumps(chunk).encode())
    assert "".join(rules.texts) == "Helf{\"a\":hm" and rules.deltas == 3
    assert StreamRules(False, (), False, lambda usage: 0).texts is None
