"""How large an answer a request may ask for, and how large a whole (non-stream) reply to it
can be: the bounds of docs/RELIABILITY.md, "Big answers".

Two numbers per request:

- its **reply tokens**, the token entries its answer may carry: every completion token Kiln
  holds for (``max_tokens × n``; a completions request's ``max_tokens × best_of`` per prompt)
  times ``1 + top_logprobs`` (chat, with ``logprobs``; OpenAI's ``top_logprobs``, 0 to 20) or
  ``1 + logprobs`` (completions, 0 to 5), since each alternative is one more entry in the
  reply. Above the model's ``max_reply_tokens`` (catalog; :data:`MAX_REPLY_TOKENS` by default)
  the request is refused before admission (400 ``invalid_value``), stream or not: no backend
  is asked for it.
- its **reply bytes**, the most a whole reply of a backend that keeps to the request can take:
  :func:`reply_bytes`. Kiln reads no more of a non-stream reply than this (and never more than
  ``KILN_MAX_REPLY_BYTES``).

Per token, :data:`TEXT_BYTES_PER_TOKEN`: no token of a chat vocabulary spans more than 64 bytes
(:data:`gateway.flow.metering.MAX_TOKEN_BYTES`), and JSON's widest escape, ``\\u00XX``, writes
one byte as 6. Per log-probability entry (OpenAI's ``{"token", "logprob", "bytes",
"top_logprobs"}``, or the completions arrays), :data:`LOGPROB_BYTES_PER_ENTRY`: the token so
escaped, its ``bytes`` array (64 numbers of up to 3 digits and a comma), the number and the
keys.
"""
from ..errors import InvalidRequest

MAX_REPLY_TOKENS = 1 << 20        # the catalog's default ``max_reply_tokens``
TOKEN_TEXT_BYTES = 64             # gateway.flow.metering.MAX_TOKEN_BYTES (flow is above us)
TEXT_BYTES_PER_TOKEN = 6 * TOKEN_TEXT_BYTES
LOGPROB_BYTES_PER_ENTRY = TEXT_BYTES_PER_TOKEN + 4 * TOKEN_TEXT_BYTES + 128
CHOICE_BYTES = 1024               # a choice's own members: index, role, finish_reason, ids
REPLY_BASE_BYTES = 64 * 1024      # the envelope: id, model, usage, system_fingerprint, ...


def reply_tokens(tokens, alternatives):
    """Token entries an answer of ``tokens`` completion tokens may carry with ``alternatives``
    alternatives each (``top_logprobs``; 0 without log probabilities)."""
    return tokens * (1 + alternatives)


def check_reply_tokens(entry, tokens, alternatives, param, terms):
    """Refuse a request whose answer may carry more than the model's ``max_reply_tokens``.

    :param tokens: completion tokens held for (``max_tokens × n``, ...).
    :param alternatives: ``top_logprobs`` (chat) or ``logprobs`` (completions), else 0.
    :param param: the field named in the error: the one the client is most likely to lower.
    :param terms: the product in the client's words, e.g. ``"n × max_tokens × (1 +
        top_logprobs) = 128 × 4096 × 21"``.
    :raises InvalidRequest: 400 ``invalid_value``.
    """
    asked = reply_tokens(tokens, alternatives)
    if asked > entry.max_reply_tokens:
        raise InvalidRequest(
            f"Invalid '{param}': {terms} = {asked:,} tokens in one answer, above the "
            f"{entry.max_reply_tokens:,} model '{entry.id}' allows; lower n, max_tokens or "
            f"the number of log probabilities asked for.", param=param, code="invalid_value")


def reply_bytes(tokens, choices, entries_per_token):
    """The most bytes a whole reply may take: its envelope, its choices, every token's text
    and every log-probability entry (``entries_per_token`` per token: ``1 + top_logprobs``
    with log probabilities, else 0)."""
    return (REPLY_BASE_BYTES + choices * CHOICE_BYTES
            + tokens * (TEXT_BYTES_PER_TOKEN + entries_per_token * LOGPROB_BYTES_PER_ENTRY))
