"""The meter's path for a plain chunk (one choice, a ``content`` delta, no usage) counts exactly
as its general path does, chunk by chunk, budget cut included (gateway/flow/metering.py)."""
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow import metering
from gateway.flow.metering import Meter

# Short deltas as most are, and long ones across the 64-byte steps of the floor.
texts = st.one_of(st.none(), st.just(""), st.text(max_size=8),
                  st.text(alphabet="ab \u00e9\u4e2d\U0001f600", min_size=30, max_size=150))
deltas = st.one_of(
    st.fixed_dictionaries({"content": texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": texts}),
    st.fixed_dictionaries({}),
    # not plain: the general path takes these in both meters
    st.fixed_dictionaries({"content": texts, "reasoning_content": texts}),
    st.fixed_dictionaries({"content": st.integers()}),
)
choices = st.fixed_dictionaries(
    {"index": st.integers(0, 2), "delta": deltas},
    optional={"finish_reason": st.sampled_from([None, "stop", "length", ""])})
chunks = st.fixed_dictionaries(
    {"choices": st.one_of(st.lists(choices, min_size=1, max_size=1),
                          st.lists(choices, max_size=3))},
    optional={"usage": st.one_of(st.none(), st.fixed_dictionaries(
        {"completion_tokens": st.integers(0, 50)}))})


def _state(meter):
    return (meter.deltas, meter.floor, meter.bytes, meter.text(), meter.finished, meter.cut,
            meter.reported)


@settings(max_examples=400, deadline=None)
@given(st.lists(chunks, max_size=40), st.integers(0, 60))
def test_the_plain_path_counts_as_the_general_one(stream, cap):
    fast, general = Meter(cap), Meter(cap)
    plain_seen = False
    for chunk in stream:
        plain_seen |= metering._plain_delta(chunk) is not None
        admitted = fast.admit_chunk(chunk)
        with mock.patch.object(metering, "_plain_delta", return_value=None):
            assert general.admit_chunk(chunk) == admitted
        assert _state(fast) == _state(general)
        if not admitted:
            break


def test_a_plain_chunk_takes_the_plain_path_and_others_do_not():
    plain = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                          "finish_reason": None}]}
    assert metering._plain_delta(plain) == (plain["choices"][0], "hi")
    for other in ({**plain, "usage": {"completion_tokens": 1}},
                  {"choices": plain["choices"] * 2},
                  {"choices": [{"index": 0, "delta": {"content": "x", "tool_calls": []}}]},
                  {"choices": [{"index": 0, "text": "x", "delta": {}}]},
                  {"choices": [{"index": 0, "delta": {"content": 3}}]}):
        assert metering._plain_delta(other) is None
