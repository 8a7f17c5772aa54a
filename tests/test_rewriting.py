"""Request rewriting, as plain functions (no HTTP): what the backend is sent for a given body."""
from decimal import Decimal

import pytest

from gateway.catalog import Backend, ModelEntry, Pricing
from gateway.errors import InvalidRequest
from gateway.validation import validate_chat

PRICING = Pricing(Decimal("0.1"), Decimal("0.05"), Decimal("0.3"))
PLAIN = ModelEntry(id="plain", context_window=4096, max_output_tokens=512, pricing=PRICING,
                   backends=(Backend("http://b/v1", "up-plain"),))
CAPABLE = ModelEntry(id="capable", context_window=4096, max_output_tokens=512, pricing=PRICING,
                     backends=(Backend("http://b/v1", "up-capable"),), parallel_tool_calls=True)
CATALOG = {"plain": PLAIN, "capable": CAPABLE}
MESSAGES = [{"role": "user", "content": "hi"}]


def rewrite(**fields):
    body = {"model": "plain", "messages": MESSAGES, **fields}
    return validate_chat(body, CATALOG, 100)


@pytest.mark.parametrize("value,expected", [(True, True), ("true", True), (1, True),
                                            (False, False), ("false", False), (0, False),
                                            (None, False)])
def test_stream_is_sent_as_a_boolean(value, expected):
    chat = rewrite(stream=value)
    assert chat.stream is expected and chat.body["stream"] is expected


def test_streams_always_ask_for_usage_and_keep_other_options():
    chat = rewrite(stream=True, stream_options={"include_usage": False, "extra": 1})
    assert chat.body["stream_options"] == {"include_usage": True, "extra": 1}
    assert chat.include_usage is False
    assert rewrite(stream=True).body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in rewrite().body


def test_max_tokens_forwarded_as_given_or_capped_at_the_model_output():
    assert rewrite(max_tokens=7).body["max_tokens"] == 7
    assert rewrite().body["max_tokens"] == 512
    assert "max_tokens" not in rewrite(max_completion_tokens=9).body


def test_parallel_tool_calls_dropped_and_enforced_where_the_model_ignores_it():
    chat = rewrite(parallel_tool_calls=False)
    assert "parallel_tool_calls" not in chat.body and chat.single_tool_call
    capable = validate_chat({"model": "capable", "messages": MESSAGES,
                             "parallel_tool_calls": False}, CATALOG, 100)
    assert capable.body["parallel_tool_calls"] is False and not capable.single_tool_call


def test_unknown_parameters_and_the_input_body_are_left_alone():
    body = {"model": "plain", "messages": MESSAGES, "stream": "true", "vendor_knob": [1, 2]}
    chat = validate_chat(body, CATALOG, 100)
    assert chat.body["vendor_knob"] == [1, 2]
    assert body["stream"] == "true" and "stream_options" not in body  # the caller's dict


def test_stop_is_normalised_to_a_tuple_for_enforcement():
    assert rewrite(stop="END").stop == ("END",)
    assert rewrite(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(InvalidRequest):
        rewrite(stop=["a", "b", "c", "d", "e"])
