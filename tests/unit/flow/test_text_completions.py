"""Kiln's rules and meter on text completions (``choices[].text``), in process: the budget cut,
stop strings across chunks, the echoed prompt neither metered nor cut, embeddings' usage."""
import json

import pytest

from gateway.billing import BY_BACKEND, BY_BOUND
from gateway.flow.answers import _parse_embeddings
from gateway.flow.metering import Meter, reconcile_embeddings_usage
from gateway.flow.rules import StreamRules, apply_to_completion
from gateway.errors import UpstreamError

pytestmark = pytest.mark.unit


def chunk(text, finish=None, index=0):
    return json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": index, "text": text, "logprobs": None,
                                    "finish_reason": finish}]}).encode()


def relay(rules, payloads):
    out = []
    for p in payloads:
        kept = rules.apply(p)
        if kept is not None:
            out.append(json.loads(kept[0])["choices"][0]["text"])
        if rules.cut:
            break
    return out


def test_the_meter_counts_text_and_cuts_at_the_budget():
    meter = Meter(cap=3)
    rules = StreamRules(meter, (), False)
    assert relay(rules, [chunk("a"), chunk("b"), chunk("c"), chunk("d")]) == ["a", "b", "c"]
    assert rules.cut and meter.floor == 3 and meter.text() == "abc"


def test_stop_strings_cut_text_across_chunks():
    rules = StreamRules(Meter(cap=100), ("STOP",), False)
    out = relay(rules, [chunk("one ST"), chunk("OP two"), chunk(" three", "length")])
    assert "".join(out) == "one " and rules.matched_stops == {0: "STOP"}


def test_the_echo_is_neither_metered_nor_cut():
    prompt = "say STOP please"
    meter = Meter(cap=2, echoed={0: prompt})
    rules = StreamRules(meter, ("STOP",), False, echoed={0: prompt})
    out = relay(rules, [chunk("say STOP "), chunk("please"), chunk(" ok"), chunk(" STOP no")])
    assert "".join(out) == prompt + " ok " and not rules.cut
    assert meter.text() == " ok STOP no" and meter.floor == 2


def test_a_server_that_does_not_echo_in_streams_is_metered_in_full():
    meter = Meter(cap=10, echoed={0: "the prompt"})
    meter.admit_chunk(json.loads(chunk("other text")))
    assert meter.text() == "other text"


def test_whole_text_completion_after_echo():
    obj = {"choices": [{"index": 0, "text": "Q: stop? A: yes stop", "finish_reason": "length"}]}
    meter = Meter(cap=10, echoed={0: "Q: stop?"})
    meter.observe_completion(obj)
    assert meter.text() == " A: yes stop"
    assert apply_to_completion(obj, ("stop",), False, {0: "Q: stop?"}) == {0: "stop"}
    assert obj["choices"][0] == {"index": 0, "text": "Q: stop? A: yes ", "finish_reason": "stop"}


@pytest.mark.parametrize("reported, expected", [
    ({"prompt_tokens": 5, "total_tokens": 5}, (5, False)),
    ({"prompt_tokens": 5}, (5, False)),
    (None, (9, True)), ({"prompt_tokens": 5.5}, (9, True)),
    ({"prompt_tokens": 5, "total_tokens": 6}, (9, True)), ({"prompt_tokens": "5"}, (9, True)),
])
def test_embeddings_usage(reported, expected):
    usage = reconcile_embeddings_usage(reported, lambda: (9, BY_BOUND))
    assert (usage.prompt, usage.estimated) == expected and usage.completion == 0
    assert usage.prompt_by == (BY_BOUND if expected[1] else BY_BACKEND)


def test_embeddings_replies_are_checked_vector_for_vector():
    reply = {"data": [{"index": 1, "embedding": [1.0, 2]}, {"index": 0, "embedding": "AACAPw=="}],
             "usage": {"prompt_tokens": 2}}
    assert _parse_embeddings(json.dumps(reply), 2) == (["AACAPw==", [1.0, 2]],
                                                       {"prompt_tokens": 2})
    pooled = {"data": [{"embedding": [[1.0, 3.0], [3.0, 5.0]]}]}
    assert _parse_embeddings(json.dumps(pooled), 1)[0] == [[2.0, 4.0]]
    for bad, n in (({"data": [{"embedding": [1.0]}]}, 2), ({"data": [{"embedding": "abc"}]}, 1),
                   ({"data": [{"index": 0, "embedding": [1]}, {"index": 0, "embedding": [1]}]},
                    2), ({"data": [{"embedding": []}]}, 1)):
        with pytest.raises(UpstreamError):
            _parse_embeddings(json.dumps(bad), n)
