"""A backend's usage whose fields contradict each other is read from above (docs/METERING.md):
the largest count any field implies is billed, the usage is flagged estimated and counted as an
anomaly; consistent usage is billed as reported."""
import pytest

from gateway.billing import BY_BACKEND, BY_BOUND, Usage
from gateway.flow.metering import Meter, reconcile_usage


def reconcile(reported):
    return reconcile_usage(reported, Meter(10_000), lambda: (999, BY_BOUND),
                           lambda: (999, BY_BOUND))


def test_consistent_usage_is_billed_as_reported():
    assert reconcile({"prompt_tokens": 10, "completion_tokens": 50, "total_tokens": 60,
                      "prompt_tokens_details": {"cached_tokens": 4},
                      "completion_tokens_details": {"reasoning_tokens": 40}}) == \
        Usage(prompt=10, cached=4, completion=50, prompt_by=BY_BACKEND, completion_by=BY_BACKEND)


@pytest.mark.parametrize("reported, prompt, cached, completion", [
    # reasoning tokens above the completion tokens that include them
    ({"prompt_tokens": 10, "completion_tokens": 5,
      "completion_tokens_details": {"reasoning_tokens": 40}}, 10, 0, 40),
    # cached tokens above the prompt that includes them
    ({"prompt_tokens": 10, "completion_tokens": 5,
      "prompt_tokens_details": {"cached_tokens": 30}}, 30, 30, 5),
    # a total above prompt + completion: the excess billed as completion
    ({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 100}, 10, 0, 90),
    # all at once
    ({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 200,
      "prompt_tokens_details": {"cached_tokens": 30},
      "completion_tokens_details": {"reasoning_tokens": 40}}, 30, 30, 170),
])
def test_self_contradicting_usage_is_billed_from_above(reported, prompt, cached, completion):
    usage = reconcile(reported)
    assert (usage.prompt, usage.cached, usage.completion) == (prompt, cached, completion)
    assert usage.estimated and usage.contradicted


def test_a_total_below_the_parts_bills_the_parts():
    """A total that is too small contradicts nothing that would lower the bill: the parts stand."""
    usage = reconcile({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 3})
    assert (usage.prompt, usage.completion, usage.contradicted) == (10, 5, False)


def test_a_long_streams_text_is_kept_whole_and_in_order():
    """The meter joins its pieces in runs (``PIECES_PER_PART``): what it hands the tokenizer is
    still every delta of every choice, in the order relayed."""
    from gateway.flow.metering import PIECES_PER_PART
    meter = Meter(10_000)
    expected = []
    for i in range(PIECES_PER_PART * 3 + 5):
        piece = f"t{i} "
        assert meter.admit_chunk({"choices": [{"index": 0, "delta": {"content": piece}}]})
        expected.append(piece)
    assert meter.text() == "".join(expected)
    assert len(meter.parts) == 3  # the joined runs; the last five pieces wait for the next run
