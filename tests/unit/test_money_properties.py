"""Properties of the money math (README, "Pricing"), over any prices and token counts: a cost
is whole nano-dollars, never negative, never above the request's hold, and equal to the exact
decimal formula rounded half-up to the nano-dollar."""
from decimal import ROUND_HALF_UP, Decimal, localcontext

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.billing import (MAX_TOKENS_COUNT, Usage, cost_nanos, cost_usd, from_nanos,
                             hold_nanos, to_nanos)
from gateway.contract.catalog import CatalogError, load_catalog
from gateway.flow.metering import prompt_bound
from factories import pricing

pytestmark = pytest.mark.unit
NANO = Decimal("0.000000001")
# Prices as a catalog allows them: USD per million tokens with at most 9 decimal places.
PRICE = st.integers(min_value=0, max_value=10**13).map(lambda n: Decimal(n) * NANO)
TOKENS = st.integers(min_value=0, max_value=MAX_TOKENS_COUNT)


@st.composite
def prices(draw):
    """A catalog price whose cached input costs at most the input (catalog rule)."""
    input_usd = draw(PRICE)
    cached = draw(PRICE.filter(lambda p: p <= input_usd)) if input_usd else Decimal(0)
    return pricing(str(input_usd), str(cached), str(draw(PRICE)))


def exact_cost_usd(usage, price):
    """The formula in exact decimals, then rounded half-up to the nano-dollar: an oracle
    independent of Kiln's integer arithmetic."""
    prompt, completion = max(usage.prompt, 0), max(usage.completion, 0)
    cached = min(max(usage.cached, 0), prompt)
    with localcontext() as ctx:
        ctx.prec = 100
        usd = ((prompt - cached) * price.input + cached * price.cached_input
               + completion * price.output) / Decimal(10**6)
        return usd.quantize(NANO, rounding=ROUND_HALF_UP)


@settings(max_examples=300, deadline=None)
@given(prompt=TOKENS, cached=TOKENS, completion=TOKENS, price=prices())
def test_cost_is_the_exact_formula_rounded_half_up(prompt, cached, completion, price):
    usage = Usage(prompt=prompt, cached=cached, completion=completion)
    nanos = cost_nanos(usage, price)
    assert isinstance(nanos, int) and nanos >= 0
    assert from_nanos(nanos) == exact_cost_usd(usage, price) == cost_usd(usage, price)
    assert cost_usd(usage, price).as_tuple().exponent >= -9  # whole nano-dollars


@settings(max_examples=300, deadline=None)
@given(price=prices(), window=st.integers(1, 10**6), body_bytes=st.integers(0, 10**8),
       messages=st.integers(1, 1000), images=st.booleans(), cap=st.integers(1, 10**6),
       data=st.data())
def test_no_cost_within_the_request_bounds_is_above_its_hold(price, window, body_bytes,
                                                             messages, images, cap, data):
    bound = prompt_bound(window, body_bytes, messages, images)
    prompt = data.draw(st.integers(0, bound), label="prompt")
    usage = Usage(prompt=prompt, cached=data.draw(st.integers(0, prompt), label="cached"),
                  completion=data.draw(st.integers(0, cap), label="completion"))
    assert 0 <= cost_nanos(usage, price) <= hold_nanos(price, bound, cap)


@settings(max_examples=300, deadline=None)
@given(nanos=st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_nanos_and_usd_convert_both_ways_exactly(nanos):
    assert to_nanos(from_nanos(nanos)) == nanos


@settings(deadline=None)  # like the others: a loaded machine's pause is no failure of the math
@given(whole=st.integers(0, 10**12), sign=st.sampled_from([1, -1]))
def test_an_exact_half_nano_rounds_away_from_zero(whole, sign):
    half = sign * (Decimal(whole) + Decimal("0.5")) * NANO
    assert to_nanos(half) == sign * (whole + 1)


@pytest.mark.parametrize("tokens,nanos", [(1, 1), (3, 2), (5, 3), (7, 4)])
def test_a_cost_at_exactly_half_a_nano_dollar_rounds_up(tokens, nanos):
    # 0.0005 USD per million tokens is half a nano-dollar per token: 2.5 nanos -> 3 (half-up;
    # half-even would give 2).
    half = pricing(input="0.0005", cached_input="0", output="0")
    assert cost_nanos(Usage(prompt=tokens), half) == nanos


def test_just_under_half_a_nano_dollar_rounds_down():
    under = pricing(input="0.000499999", cached_input="0", output="0.000500001")
    assert cost_nanos(Usage(prompt=1), under) == 0
    assert cost_nanos(Usage(completion=1), under) == 1


def test_a_catalog_price_with_cached_input_above_input_is_refused(tmp_path):
    """Else a prompt served from cache could cost more than its hold, which assumes none."""
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nid = "m"\ncontext_window = 4096\nmax_output_tokens = 512\n'
                    'pricing = { input = "0.10", cached_input = "0.11", output = "0.30" }\n'
                    'backends = [{ url = "http://127.0.0.1:9/v1", model = "m" }]\n')
    with pytest.raises(CatalogError, match="cached_input above input"):
        load_catalog(str(path))
    path.write_text(path.read_text().replace('"0.11"', '"0.10"'))
    assert load_catalog(str(path))["m"].pricing.cached_input == Decimal("0.10")
