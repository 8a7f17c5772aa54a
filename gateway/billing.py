"""Money math, pure: token counts, prices, holds, nano-dollar rounding. No database here.

Money is Decimal USD in Python and integer nano-dollars (1 USD = 10**9) in the tables, never a
binary float (README, "Pricing"). The statements that move money are in :mod:`gateway.ledger`.
"""
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

NANOS_PER_USD = Decimal(10 ** 9)
MILLION, HALF_MILLION = 10 ** 6, 5 * 10 ** 5
MAX_TOKENS_COUNT = 2 ** 31 - 1  # the token columns are 32-bit; no real generation is near it

# Which count a usage event bills, per kind of token (usage_events.prompt_counted_by and
# completion_counted_by; docs/METERING.md, "Which count applies"): the backend's reported usage;
# Kiln's tokenizer (the model's local tokenizer, or the backend's tokenize endpoint), exact; an
# upward bound (the text's UTF-8 bytes, a template allowance, the relayed floor); the progress
# the worker last recorded, billed by the sweeper when the worker was lost.
BY_BACKEND, BY_TOKENIZER, BY_BOUND, BY_PROGRESS = "backend", "tokenizer", "bound", "progress"
COUNTED_BY = (BY_BACKEND, BY_TOKENIZER, BY_BOUND, BY_PROGRESS)


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation. ``completion`` includes reasoning tokens; ``estimated``
    marks counts that Kiln made itself (:mod:`gateway.flow.metering`); ``contradicted``, a
    backend's usage whose fields disagreed, read from above (an anomaly); ``prompt_by`` and
    ``completion_by``, which count each is (:data:`COUNTED_BY`; None: nothing was counted)."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    estimated: bool = False
    contradicted: bool = False
    prompt_by: str = None
    completion_by: str = None

    @classmethod
    def from_openai(cls, usage, estimated=False):
        """Read an OpenAI ``usage`` object taking only well-formed counts; others are 0.

        For billing a backend's report, use :func:`gateway.flow.metering.reconcile_usage`, which
        replaces a malformed count by Kiln's own instead of 0.
        """
        usage = usage if isinstance(usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(prompt=token_count(usage.get("prompt_tokens")) or 0,
                   cached=token_count(cached) or 0,
                   completion=token_count(usage.get("completion_tokens")) or 0,
                   estimated=estimated)

    def to_openai(self):
        """Return the OpenAI ``usage`` object (without cost): whole integers,
        ``total_tokens = prompt_tokens + completion_tokens``."""
        out = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
               "total_tokens": self.prompt + self.completion}
        if self.cached:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out


def token_count(value):
    """Return ``value`` as a token count, or None when it is not one.

    A count is a non-negative whole number: an int, or a float with no fraction (``5.0``).
    Null, strings, booleans, negatives, fractions, NaN and infinities are not counts.
    Counts above the columns' range are clamped to it.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not value.is_integer():  # also NaN and the infinities
            return None
        value = int(value)
    if not isinstance(value, int) or value < 0:
        return None
    return min(value, MAX_TOKENS_COUNT)


def cost_nanos(usage, pricing):
    """Price ``usage`` in integer nano-dollars, exact, rounded half-up.

    ``cost = (prompt - cached) * input + cached * cached_input + completion * output`` with
    prices per million tokens; ``cached`` is clamped to ``[0, prompt]`` (README, "Pricing").
    Prices are whole nano-dollars per million tokens (the catalog checks it), so this is
    integer arithmetic: ``(Σ tokens × price + 500,000) // 1,000,000``.

    :param usage: :class:`Usage`.
    :param pricing: :class:`gateway.contract.catalog.Pricing`.
    :returns: int nano-dollars, never negative.
    """
    prompt = max(usage.prompt, 0)
    cached = min(max(usage.cached, 0), prompt)
    price_in, price_cached, price_out = pricing.nanos
    scaled = ((prompt - cached) * price_in + cached * price_cached
              + max(usage.completion, 0) * price_out)
    return (scaled + HALF_MILLION) // MILLION


def cost_usd(usage, pricing):
    """Price ``usage`` in USD (Decimal), exact, rounded half-up to the nano-dollar
    (:func:`cost_nanos`)."""
    return from_nanos(cost_nanos(usage, pricing))


def to_nanos(usd):
    """Return integer nano-dollars for a Decimal USD amount, rounded half-up."""
    return int((usd * NANOS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def from_nanos(nanos):
    """Return Decimal USD for integer nano-dollars."""
    return Decimal(int(nanos)) / NANOS_PER_USD


def format_usd(nanos):
    """Return nano-dollars as a plain decimal string of USD (``"0.0000186"``)."""
    return format(from_nanos(nanos).normalize(), "f")


def format_dollars(nanos):
    """Return nano-dollars as a customer reads them: the dollar sign, at least two decimal
    places, every nano-dollar there is (``"$0.0000186"``, ``"$12.00"``, ``"-$0.50"``); never
    the exponent form a Decimal of zero takes (``0E-9``)."""
    text = format_usd(abs(int(nanos)))
    whole, _, cents = text.partition(".")
    return f"{'-' if nanos < 0 else ''}${whole}.{cents.ljust(2, '0')}"


def hold_nanos(pricing, prompt_bound, completion_cap):
    """Return the hold in nano-dollars: the cost of the request's worst case.

    :param prompt_bound: tokens the prompt can have at most
        (:func:`gateway.flow.metering.prompt_bound`).
    :param completion_cap: completion tokens Kiln lets the generation produce, all choices
        together (``max_tokens × n``); the relay stops the backend there.
    """
    return cost_nanos(Usage(prompt=prompt_bound, completion=completion_cap), pricing)


# Chat-template tokens around each message and around the whole prompt (role markers, a default
# system prompt some templates add). Generous on purpose: an estimate must not fall short.
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS_PER_REQUEST = 32


def prompt_bound(context_window, body_bytes, n_messages, has_images):
    """Return the most prompt tokens a request can have: its body's bytes plus the template's
    tokens, at most the context window; a request with images may fill the window.

    :param body_bytes: size of the client's JSON body.
    """
    if has_images:
        return context_window
    bound = body_bytes + TEMPLATE_TOKENS_PER_MESSAGE * n_messages + TEMPLATE_TOKENS_PER_REQUEST
    return min(bound, context_window)
