"""Pricing and holds: exact Decimal arithmetic (README, "Pricing")."""
from decimal import Decimal

import pytest

from gateway.billing import Usage, cost_usd, format_dollars, from_nanos, hold_nanos, to_nanos
from gateway.flow.metering import Meter, estimate_completion, prompt_bound
from factories import pricing
from gateway.contract.catalog import Pricing

pytestmark = pytest.mark.unit

PRICING = pricing()  # 0.10 / 0.05 / 0.30 USD per million tokens


def test_cost_formula_plain():
    # 9 prompt, 12 completion at 0.10 / 0.30 per million.
    assert cost_usd(Usage(prompt=9, completion=12), PRICING) == Decimal("0.0000045")


def test_cached_tokens_priced_at_cached_rate():
    usage = Usage(prompt=1000, cached=400, completion=0)
    assert cost_usd(usage, PRICING) == Decimal("600") * Decimal("0.10") / 10**6 + \
        Decimal("400") * Decimal("0.05") / 10**6


def test_cached_above_prompt_is_clamped():
    assert cost_usd(Usage(prompt=100, cached=500), PRICING) == cost_usd(
        Usage(prompt=100, cached=100), PRICING)


def test_reasoning_tokens_are_not_added_again():
    # Reasoning tokens are inside completion_tokens: only completion_tokens is billed.
    usage = Usage.from_openai({"prompt_tokens": 10, "completion_tokens": 50,
                               "completion_tokens_details": {"reasoning_tokens": 40}})
    assert cost_usd(usage, PRICING) == (Decimal(10) * Decimal("0.10")
                                        + Decimal(50) * Decimal("0.30")) / 10**6


@pytest.mark.parametrize("usage", [{"prompt_tokens": -5, "completion_tokens": -1},
                                   {"prompt_tokens": None, "completion_tokens": "7"},
                                   {"prompt_tokens": True}, None, {}])
def test_no_negative_or_garbage_cost(usage):
    assert cost_usd(Usage.from_openai(usage), PRICING) == 0


def test_cost_is_rounded_half_up_to_the_nano_dollar():
    odd = Pricing(input=Decimal("0.123456"), cached_input=Decimal("0"), output=Decimal("0"))
    # 1 token at 0.123456 USD/M = 0.000000123456 USD -> 0.000000123
    assert cost_usd(Usage(prompt=1), odd) == Decimal("0.000000123")
    assert cost_usd(Usage(prompt=5), odd) == Decimal("0.000000617")  # 617.28 nanos


def test_nanos_round_trip_is_exact():
    for usd in ("0.000000001", "5", "12.345678901", "0"):
        assert from_nanos(to_nanos(Decimal(usd))) == Decimal(usd)


def test_hold_bounds_prompt_by_bytes_and_context_window():
    small = hold_nanos(PRICING, prompt_bound(4096, 100, 1, False), 10)
    assert small == (100 + 8 + 32) * 100 + 10 * 300  # nano-dollars per token: 100 and 300
    huge = hold_nanos(PRICING, prompt_bound(4096, 10**7, 1, False), 10)
    assert huge == 4096 * 100 + 10 * 300


def test_hold_of_a_request_with_images_assumes_the_whole_window():
    assert prompt_bound(4096, 10, 1, True) == 4096


# -- Kiln's own completion count (gateway/flow/metering.py) ----------------------------------------

def _delta(text):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


@pytest.mark.parametrize("size, floor", [(1, 1), (64, 1), (65, 2), (2000, 32)])
def test_a_delta_counts_one_token_per_64_bytes_at_least(size, floor):
    meter = Meter(cap=100)
    assert meter.admit_chunk(_delta("é" * (size // 2) + "x" * (size % 2)))
    assert (meter.deltas, meter.floor, meter.bytes) == (1, floor, size)


def test_the_delta_that_would_pass_the_cap_by_its_bytes_is_refused():
    meter = Meter(cap=40)
    assert meter.admit_chunk(_delta("w" * 2000))        # 32 tokens at least
    assert not meter.admit_chunk(_delta("w" * 640))     # 10 more: 42 > 40
    assert meter.cut and meter.floor == 32 and not meter.overran


def test_without_a_tokenizer_the_estimate_is_the_bytes_capped_until_proven_past_the_cap():
    within = Meter(cap=100)
    within.observe_completion({"choices": [{"message": {"content": "x" * 400}}]})
    assert estimate_completion(within, lambda _text: None) == 100   # 400 bytes, cap 100
    past = Meter(cap=5)
    past.observe_completion({"choices": [{"message": {"content": "x" * 400}}]})
    assert past.overran and estimate_completion(past, lambda _text: None) == 400
    assert estimate_completion(past, lambda _text: 90) == 90  # the tokenizer's count wins


@pytest.mark.parametrize("nanos, text", [
    (0, "$0.00"), (1, "$0.000000001"), (18_600, "$0.0000186"), (12 * 10**9, "$12.00"),
    (10**7, "$0.01"), (-5 * 10**8, "-$0.50"), (1_234_567_890_123, "$1234.567890123"),
])
def test_dollars_as_a_customer_reads_them(nanos, text):
    assert format_dollars(nanos) == text
