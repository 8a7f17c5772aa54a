"""Token metering, pure: what a generation produced, counted as Kiln relays it, and Kiln's own
counts where a backend reports none or reports nonsense. No I/O here: a tokenizer (the model's
local one, else the backend's tokenize endpoint) is passed in as a ``count(text) -> int | None``
callable.

Kiln is paid for tokens, so its own counts err upward (docs/METERING.md gives the bounds):

- the prompt: the tokenizer on everything sent (message text and parts, tool definitions, tool
  calls and names in the history) plus an allowance for the chat template's tokens, or, when no
  tokenizer answers, the UTF-8 bytes of that text (a byte-level BPE token covers at least one
  byte); at most the context window. Always a bound: the template is the backend's;
- the completion: the tokenizer on everything generated (content, reasoning, refusals,
  tool-call names and arguments, every choice), exact, or without one its bytes capped by the
  budget (a bound); never fewer than
  the tokens the relay counted (each delta carries at least one token, and at least one per
  :data:`MAX_TOKEN_BYTES` bytes of its text). A reply proven by that count to hold more than
  the budget (a non-stream reply cannot be cut) is billed its bytes, uncapped: the cap it was
  sent no longer bounds it.
"""
import json
import math

from ..billing import (BY_BACKEND, BY_BOUND, TEMPLATE_TOKENS_PER_MESSAGE,
                       TEMPLATE_TOKENS_PER_REQUEST, Usage, prompt_bound,  # noqa: F401 (offered)
                       token_count)

# Fields of a delta (stream) or a message (non-stream) that carry generated text.
GENERATED_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")
# No token of a chat model's vocabulary spans more UTF-8 bytes than this (the longest tokens of
# the common BPE vocabularies are runs of spaces or punctuation well below it), so a delta holds
# at least ``ceil(bytes / MAX_TOKEN_BYTES)`` tokens: a count that never exceeds the true one,
# and that a backend packing many tokens into each delta cannot stay under.
MAX_TOKEN_BYTES = 64
# Tokens a raw prompt or an embeddings input may add to its text's (a begin and an end marker),
# which also covers a token merged across the newline joining two of them for one count.
SPECIAL_TOKENS_PER_ITEM = 2


class EchoSkip:
    """Tell a text completion's echoed prompt (``echo``) from its generated text, choice by
    choice: text that continues the prompt is the echo; the first text that does not ends it
    (a server that does not echo in a stream sends generated text at once)."""

    def __init__(self, echoed):
        self._left = {i: text for i, text in (echoed or {}).items() if text}

    def split(self, index, text):
        """Return ``(echo, generated)`` of the next ``text`` of choice ``index``."""
        left = self._left.get(index)
        if not left or not text:
            return "", text
        if left.startswith(text):
            self._left[index] = left[len(text):]
            return text, ""
        del self._left[index]
        if text.startswith(left):
            return left, text[len(left):]
        return "", text


PIECES_PER_PART = 64  # a stream's pieces of text joined into one kept string (Meter._keep)


class Meter:
    """Counts a generation as it is relayed, and keeps it within its budget.

    :param cap: completion tokens Kiln held for (``max_tokens × n``); the relay stops there.
    :param echoed: ``{choice index: prompt text}`` a text completion echoes before its
        generated text (``echo``): the prompt, not counted as generated.
    """

    def __init__(self, cap, echoed=None):
        self.cap = cap
        self._echo = EchoSkip(echoed)
        self.deltas = 0          # deltas with generated text relayed (each ≥ 1 token)
        self.floor = 0           # tokens relayed at least: Σ max(1, ⌈delta bytes / 64⌉)
        self.bytes = 0           # UTF-8 bytes of the generated text relayed
        self.parts = []          # the generated text: joined runs of PIECES_PER_PART pieces
        self._recent = []        # ... and the pieces after the last run
        self.reported = None     # the last usage object the backend sent (running or final)
        self.finished = set()    # choice indexes that carried a finish_reason
        self.cut = False         # Kiln stopped the generation at its budget
        self.refused = False     # the backend's stream began with an error: nothing generated

    @property
    def generated(self):
        """Completion tokens known so far: the backend's running count or Kiln's floor (at
        least one per delta and per :data:`MAX_TOKEN_BYTES` bytes), whichever is larger."""
        reported = token_count((self.reported or {}).get("completion_tokens"))
        return max(self.floor, reported or 0)

    @property
    def overran(self):
        """Whether more than the budget is proven to have reached the client (by Kiln's floor or
        the backend's own count; a non-stream reply, which cannot be cut): the cap no longer
        bounds an estimate of it."""
        return self.generated > self.cap

    def admit_chunk(self, chunk):
        """Count a stream chunk (dict) if it fits in the budget; return whether it does.

        A chunk that would take the generation past ``cap`` is not counted: the caller stops
        relaying there (and the backend) and ends the choices with ``finish_reason: "length"``.
        """
        plain = _plain_delta(chunk)
        if plain is not None:
            return self._admit_plain(*plain)
        usage = chunk.get("usage")
        running = token_count(usage.get("completion_tokens")) if isinstance(usage, dict) else None
        choices = chunk.get("choices")
        choices = choices if isinstance(choices, list) else ()
        per_choice = [self._pieces(choice, "delta") for choice in choices]
        pieces = [p for texts in per_choice for p in texts]
        deltas = sum(1 for texts in per_choice if any(texts))
        floor, size = _floor(per_choice)
        if deltas and (self.floor + floor > self.cap or (running or 0) > self.cap):
            self.cut = True
            return False
        if isinstance(usage, dict):
            self.reported = usage
        self.deltas += deltas
        self.floor += floor
        self.bytes += size
        self._keep(pieces)
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finished.add(choice.get("index", 0))
        return True

    def _admit_plain(self, choice, text):
        """:meth:`admit_chunk` for the chunk almost every stream is made of (one choice, a
        delta of ``content`` and perhaps ``role``, no usage): the same counts, without the
        general case's lists (a streamed chunk's cost is mostly Kiln's reading of it,
        bench/RESULTS.md, the relay)."""
        if text:
            size = len(text) if text.isascii() else _utf8_len(text)
            floor = max(1, (size + MAX_TOKEN_BYTES - 1) // MAX_TOKEN_BYTES)
            if self.floor + floor > self.cap:
                self.cut = True
                return False
            self.deltas += 1
            self.floor += floor
            self.bytes += size
            recent = self._recent
            recent.append(text)
            if len(recent) >= PIECES_PER_PART:
                self.parts.append("".join(recent))
                recent.clear()
        if choice.get("finish_reason"):
            self.finished.add(choice.get("index", 0))
        return True

    def observe_completion(self, completion):
        """Count a whole (non-stream) chat or text completion (dict)."""
        choices = completion.get("choices")
        choices = choices if isinstance(choices, list) else ()
        per_choice = [self._pieces(choice, "message") for choice in choices]
        for texts in per_choice:
            self._keep(texts)
            self.deltas += 1 if any(texts) else 0
        floor, size = _floor(per_choice)
        self.floor += floor
        self.bytes += size
        if isinstance(completion.get("usage"), dict):
            self.reported = completion["usage"]

    def text(self):
        """Return everything generated so far as one string."""
        return "".join(self.parts) + "".join(self._recent)

    def _keep(self, pieces):
        """Keep ``pieces`` (strings) for :meth:`text`. A stream's deltas are a token or two
        each, and a string object costs about 50 bytes beyond its text: every
        :data:`PIECES_PER_PART` pieces are joined into one, so that an open stream's text costs
        about its own size (bench/RESULTS.md, bursts)."""
        recent = self._recent
        recent.extend(pieces)
        if len(recent) >= PIECES_PER_PART:
            self.parts.append("".join(recent))
            recent.clear()

    def _pieces(self, choice, field):
        """The generated strings of one choice: a chat choice's ``delta`` or ``message``
        fields, or a text completion's ``text`` after the echoed prompt."""
        pieces = list(_choice_text(choice, field))
        text = choice.get("text") if isinstance(choice, dict) else None
        if isinstance(text, str):
            pieces.append(self._echo.split(choice.get("index", 0), text)[1])
        return pieces


_PLAIN_DELTA_FIELDS = frozenset(("role", "content"))


def _plain_delta(chunk):
    """``(choice, content)`` of a chunk of one chat choice whose delta holds only ``content``
    (a string, or none) and ``role``, with no usage; None for any other chunk."""
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1 or chunk.get("usage") is not None:
        return None
    choice = choices[0]
    if type(choice) is not dict or "text" in choice:
        return None
    delta = choice.get("delta")
    if type(delta) is not dict or not delta.keys() <= _PLAIN_DELTA_FIELDS:
        return None
    text = delta.get("content")
    if text is None:
        return choice, ""
    return (choice, text) if type(text) is str else None


def _choice_text(choice, field):
    """Yield the generated strings of one choice's ``delta`` or ``message``."""
    body = choice.get(field) if isinstance(choice, dict) else None
    if not isinstance(body, dict):
        return
    for name in GENERATED_TEXT_FIELDS:
        if isinstance(body.get(name), str):
            yield body[name]
    calls = body.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    if isinstance(body.get("function_call"), dict):
        calls = calls + [{"function": body["function_call"]}]
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            for name in ("name", "arguments"):
                if isinstance(function.get(name), str):
                    yield function[name]


def _floor(per_choice):
    """Return ``(tokens at least, UTF-8 bytes)`` of the generated text of each choice (a list
    of its strings): per choice that generated anything, one token and one more per
    :data:`MAX_TOKEN_BYTES` bytes."""
    floor = size = 0
    for texts in per_choice:
        n = sum(_utf8_len(text) for text in texts)
        if n or any(texts):
            floor += max(1, math.ceil(n / MAX_TOKEN_BYTES))
            size += n
    return floor, size


def _utf8_len(text):
    return len(text.encode("utf-8", "surrogatepass"))


def prompt_text(body):
    """Return the text of everything a request sends the model: message text and parts, names,
    tool calls in the history, and the tool definitions (as JSON, as templates render them).

    :param body: the request body (dict) as built for the backend.
    """
    out = []
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            out.extend(_message_text(message))
    if body.get("tools"):
        out.append(json.dumps(body["tools"], ensure_ascii=False))
    return "\n".join(out)


def _message_text(message):
    if isinstance(message.get("name"), str):
        yield message["name"]
    content = message.get("content")
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                for name in ("text", "refusal"):
                    if isinstance(part.get(name), str):
                        yield part[name]
    if isinstance(message.get("refusal"), str):
        yield message["refusal"]
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            yield json.dumps(function, ensure_ascii=False)


def estimate_prompt(body, n_messages, context_window, has_images, count):
    """Return Kiln's upper estimate of the prompt tokens of ``body`` (see the module doc).

    :param count: ``text -> int | None``, the backend's tokenizer (None: it did not answer).
    """
    if has_images:
        return context_window  # images' tokens are the backend's to tell; the bound is the window
    text = prompt_text(body)
    counted = count(text) if text else 0
    if counted is None:
        counted = len(text.encode("utf-8", "surrogatepass"))
    overhead = TEMPLATE_TOKENS_PER_MESSAGE * n_messages + TEMPLATE_TOKENS_PER_REQUEST
    return min(counted + overhead, context_window)


def estimate_text_prompt(items, suffix, item_bound, count):
    """Return Kiln's upper estimate of the prompt tokens of raw prompts or embeddings inputs.

    Token arrays count their length; text is counted by the backend's tokenizer in one call
    (joined by newlines), else by its UTF-8 bytes; each item adds
    :data:`SPECIAL_TOKENS_PER_ITEM` (its begin and end markers, and a merge across a join),
    and is at most ``item_bound`` tokens.

    :param suffix: a completions ``suffix`` (counted as text), or None.
    :param count: ``text -> int | None``, the backend's tokenizer (None: it did not answer).
    """
    texts = [i for i in items if isinstance(i, str)] + ([suffix] if suffix else [])
    tokens = sum(min(len(i) + SPECIAL_TOKENS_PER_ITEM, item_bound)
                 for i in items if not isinstance(i, str))
    if not texts:
        return tokens
    joined = "\n".join(texts)
    counted = count(joined) if joined else 0
    if counted is None:
        counted = _utf8_len(joined)
    counted += SPECIAL_TOKENS_PER_ITEM * len(texts)
    return tokens + min(counted, item_bound * len(texts))


def estimate_completion(meter, count):
    """Return Kiln's upper estimate of the completion tokens counted by ``meter``.

    :param count: ``text -> int | None``, the backend's tokenizer (None: it did not answer);
        without an answer, the generated text's bytes: at most the budget, unless the
        generation is proven to have run past it (:attr:`Meter.overran`).
    """
    text = meter.text()
    counted = count(text) if text else 0
    if counted is None:
        size = _utf8_len(text)
        counted = size if meter.overran else min(size, meter.cap)
    return max(counted, meter.generated)


def oversized_completion(bytes_read, cap):
    """Return the completion tokens billed for a whole reply too large to read
    (docs/METERING.md, "A reply too large to relay"): one token per :data:`MAX_TOKEN_BYTES`
    of the bytes read (the floor, applied to all of the reply read, its JSON included: it
    errs upward), never above ``cap``, the completion the hold covers and the backend was
    sent as its limit.

    A reply over its request's own bound (:mod:`gateway.contract.replies`) is always billed
    ``cap``: that bound allows more than :data:`MAX_TOKEN_BYTES` per token of the cap.
    """
    if cap <= 0:
        return 0
    return min(cap, max(1, math.ceil(bytes_read / MAX_TOKEN_BYTES)))


def reconcile_usage(reported, meter, own_prompt, own_completion):
    """Return the :class:`Usage` to bill from a backend's ``usage`` object and Kiln's counts.

    Each count is taken from the backend when it is a well-formed count, else from Kiln's own
    (a null, missing, string, negative or fractional count is never billed as 0). A reported
    completion below the tokens Kiln counted relaying it (:attr:`Meter.floor`) is raised to
    them (a bound). Own counts are computed only when needed.

    :param reported: the backend's ``usage`` object, or None.
    :param own_prompt: ``() -> (tokens, counted by)``, Kiln's prompt count and which count it
        is (:data:`gateway.billing.COUNTED_BY`).
    :param own_completion: ``() -> (tokens, counted by)``, Kiln's completion count.
    :returns: :class:`Usage`; ``estimated`` when any count is Kiln's; ``prompt_by`` and
        ``completion_by`` say which count each is.
    """
    reported = reported if isinstance(reported, dict) else {}
    prompt = token_count(reported.get("prompt_tokens"))
    completion = token_count(reported.get("completion_tokens"))
    details = reported.get("prompt_tokens_details")
    cached = token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
    estimated = prompt is None or completion is None
    prompt_by = completion_by = BY_BACKEND
    if prompt is None:
        prompt, prompt_by = own_prompt()
    if completion is None:
        completion, completion_by = own_completion()
    elif completion < meter.floor:
        completion, completion_by, estimated = meter.floor, BY_BOUND, True
    prompt, completion, contradicted = _from_above(reported, prompt, cached, completion)
    return Usage(prompt=prompt, cached=min(cached or 0, prompt), completion=completion,
                 estimated=estimated or contradicted, contradicted=contradicted,
                 prompt_by=prompt_by, completion_by=completion_by)


def _from_above(reported, prompt, cached, completion):
    """Return ``(prompt, completion, contradicted)``: the largest counts a backend's usage
    fields imply when they disagree (reasoning tokens above the completion tokens that include
    them, cached tokens above the prompt that includes them, a total above prompt +
    completion, whose excess is billed as completion, the dearer kind). A customer never pays
    less because a backend's arithmetic is off."""
    details = reported.get("completion_tokens_details")
    reasoning = token_count(details.get("reasoning_tokens")) if isinstance(details, dict) \
        else None
    total = token_count(reported.get("total_tokens"))
    contradicted = False
    if reasoning is not None and reasoning > completion:
        completion, contradicted = reasoning, True
    if cached is not None and cached > prompt:
        prompt, contradicted = cached, True
    if total is not None and total > prompt + completion:
        completion, contradicted = total - prompt, True
    return prompt, completion, contradicted


def reconcile_embeddings_usage(reported, own_prompt):
    """Return the :class:`Usage` of an embeddings answer: the backend's ``prompt_tokens``
    when it is a count (and ``total_tokens``, when sent, says the same), else Kiln's own
    estimate (``estimated``); nothing is generated.

    :param own_prompt: ``() -> (tokens, counted by)``, Kiln's estimate of the inputs' tokens.
    """
    reported = reported if isinstance(reported, dict) else {}
    prompt = token_count(reported.get("prompt_tokens"))
    total = reported.get("total_tokens", prompt)
    if prompt is None or token_count(total) != prompt:
        prompt, prompt_by = own_prompt()
        return Usage(prompt=prompt, estimated=True, prompt_by=prompt_by)
    return Usage(prompt=prompt, prompt_by=BY_BACKEND)


def is_well_formed(reported, usage):
    """Tell whether a backend's ``usage`` object already says exactly ``usage`` (whole counts,
    ``total_tokens`` their sum), so that it can be relayed as sent with only ``cost`` added."""
    if not isinstance(reported, dict) or usage.estimated:
        return False
    details = reported.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return (type(reported.get("prompt_tokens")) is int
            and type(reported.get("completion_tokens")) is int
            and reported.get("total_tokens") == usage.prompt + usage.completion
            and reported["prompt_tokens"] == usage.prompt
            and reported["completion_tokens"] == usage.completion
            and (cached or 0) == usage.cached and type(cached or 0) is int)
