"""The request contracts of ``POST /v1/completions`` and ``POST /v1/embeddings`` (OpenAI's
legacy completions and its embeddings API: https://platform.openai.com/docs/api-reference/
completions and .../embeddings), checked before admission, and the body each backend family
is sent (docs/PARAMETERS.md, "Completions" and "Embeddings").

Like chat's (:mod:`gateway.contract.validation`), every field has one row in a table: Kiln
writes it, forwards it to the families that read it, drops it, or refuses it; any other field is
a 400 ``unknown_parameter`` unless the catalog allows it by name (``extra_params``). Length is
Kiln's: the backend gets the cap Kiln held for. A rejected request calls no backend and charges
nothing.
"""
from dataclasses import dataclass, field

from ..billing import TEMPLATE_TOKENS_PER_MESSAGE, TEMPLATE_TOKENS_PER_REQUEST
from ..errors import InvalidRequest, UnknownParameter, UnsupportedParameter
from . import parameters, replies
from .catalog import COMPLETIONS, EMBEDDINGS
from .families import family_of
from .parameters import DROP, FORWARD, KILN, is_int
from .validation import (BACKEND_PATHS, EMBEDDINGS_ANSWER, MAX_BYTES_PER_TOKEN, TEXT_ANSWER,
                         model_for)

# What Kiln does with each field of a completions request (the openai SDK's
# ``CompletionCreateParams``, plus ``stream``).
COMPLETION_PARAMETERS = {
    "model": KILN, "prompt": KILN, "max_tokens": KILN, "stream": KILN, "stream_options": KILN,
    "suffix": FORWARD, "n": FORWARD, "best_of": FORWARD, "echo": FORWARD, "logprobs": FORWARD,
    "stop": FORWARD, "temperature": FORWARD, "top_p": FORWARD, "seed": FORWARD,
    "presence_penalty": FORWARD, "frequency_penalty": FORWARD, "logit_bias": FORWARD,
    "user": DROP,
}
# ... and of an embeddings request (the SDK's ``EmbeddingCreateParams``): there is no stream.
EMBEDDING_PARAMETERS = {"model": KILN, "input": KILN, "encoding_format": KILN,
                        "dimensions": FORWARD, "user": DROP}
MAX_LOGPROBS = 5          # OpenAI's bound on completions ``logprobs``
MAX_PROMPTS = 2048        # prompts in one completions request (OpenAI's bound on arrays)
MAX_TOKEN_ID = 2 ** 31 - 1
ENCODING_FORMATS = ("float", "base64")


def _refuse_unknown(body, table, entry):
    """Refuse a field the endpoint does not have; return the catalog-allowed extras."""
    extras = {}
    for name, value in body.items():
        if name in table:
            continue
        if name in entry.extra_params:
            extras[name] = value
        else:
            raise UnknownParameter(name[:100], f"Unrecognized request argument supplied: "
                                               f"{name[:100]}")
    return extras


def _prompts(value, name, entry, max_tokens_each, empty_string_ok):
    """Read a prompt or input: a string, an array of strings, a token array, or an array of
    token arrays; return ``(list of str | list of int, given as token ids)``.

    :raises InvalidRequest: a wrong shape, an empty array, a token id that is not one, a token
        array above ``max_tokens_each`` or a string that cannot fit it even at
        :data:`~gateway.contract.validation.MAX_BYTES_PER_TOKEN` bytes per token.
    """
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{name}'.", param=name,
                             code="missing_required_parameter")
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        items = None
    if items == []:
        raise InvalidRequest(f"Invalid '{name}': the array must contain at least one element.",
                             param=name, code="empty_array")
    shapes = {type(i) for i in items} if items else set()
    if not items or not shapes <= {str, list} or len(shapes) != 1:
        raise InvalidRequest(f"Invalid '{name}': expected a string, an array of strings, an "
                             f"array of token ids or an array of such arrays.", param=name,
                             code="invalid_type")
    single = items[0] is value  # one string or one token array, not an array of them
    for i, item in enumerate(items):
        where = name if single else f"{name}[{i}]"
        if isinstance(item, str):
            if not item and not empty_string_ok:
                raise InvalidRequest(f"Invalid '{where}': expected a non-empty string.",
                                     param=where, code="invalid_value")
            size = len(item.encode("utf-8", "surrogatepass"))
            if size > max_tokens_each * MAX_BYTES_PER_TOKEN:
                raise InvalidRequest(f"Invalid '{where}': {size} bytes cannot fit the "
                                     f"{max_tokens_each} tokens an input of model "
                                     f"'{entry.id}' may have.", param=where,
                                     code="context_length_exceeded")
            continue
        if not item or not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in item):
            raise InvalidRequest(f"Invalid '{where}': expected a non-empty array of token ids "
                                 f"(integers, 0 or more).", param=where, code="invalid_value")
        if len(item) > max_tokens_each:
            raise InvalidRequest(f"Invalid '{where}': {len(item)} tokens are more than the "
                                 f"{max_tokens_each} an input of model '{entry.id}' may "
                                 f"have.", param=where, code="context_length_exceeded")
    return items, shapes == {list}


def _as_sent(items):
    """The prompt or input as a backend reads it: one item alone, several as an array."""
    return items[0] if len(items) == 1 else items


def _check_shapes(entry, items, tokens, name):
    """Refuse what a backend's family cannot read: several completions prompts, token ids."""
    for backend in entry.backends:
        family = family_of(backend.server)
        if len(items) > 1 and name == "prompt" and not family.prompt_arrays:
            raise InvalidRequest(f"Unsupported value: '{name}' must be one string for model "
                                 f"'{entry.id}' (its model server reads one per request); send "
                                 f"several requests instead.", param=name,
                                 code="unsupported_value")
        if tokens and not family.token_prompts:
            raise InvalidRequest(f"Unsupported value: '{name}' must be text for model "
                                 f"'{entry.id}' (its model server does not read token ids).",
                                 param=name, code="unsupported_value")


def _family_reads(entry, name):
    return all(name in family_of(b.server).completion_params for b in entry.backends)


# -- completions ------------------------------------------------------------------------------

@dataclass
class CompletionRequest:
    """A validated completions request: the prompts, what is forwarded, what Kiln enforces."""

    kind = TEXT_ANSWER
    path = BACKEND_PATHS[COMPLETIONS]

    entry: object
    prompts: list            # each a string or a list of token ids
    token_prompts: bool      # the prompts are token ids
    params: dict             # forwarded parameters, validated (None values dropped)
    stream: bool
    include_usage: bool
    stop: tuple
    max_tokens: int          # the cap of one candidate (0 with echo: the prompt scored only)
    n: int                   # choices returned per prompt
    best_of: int             # candidates generated per prompt (at least n)
    echo: bool
    body_bytes: int
    single_tool_call: bool = False
    has_images: bool = False
    extras: dict = field(default_factory=dict)
    response_headers: dict = field(default_factory=dict)

    @property
    def completion_cap(self):
        """Completion tokens held for: every candidate of every prompt at its cap, and, when
        the prompts are token ids and echoed, the echo (Kiln cannot tell its text from the
        generated text: docs/METERING.md, "Completions")."""
        cap = self.max_tokens * self.best_of * len(self.prompts)
        if self.echo and self.token_prompts:
            cap += self.n * sum(len(p) for p in self.prompts)
        return cap

    @property
    def n_choices(self):
        return self.n * len(self.prompts)

    @property
    def reply_bound(self):
        """The most bytes a whole reply can take (docs/RELIABILITY.md, "Big answers"): every
        candidate's text, an echoed prompt in each choice, and ``logprobs`` entries for all of
        them; None with catalog-allowed extra parameters (``KILN_MAX_REPLY_BYTES`` alone)."""
        if self.extras:
            return None
        tokens = self.completion_cap
        if self.echo and not self.token_prompts:  # token prompts' echo is in the cap
            tokens += self.n * self.prompt_bound
        logprobs = self.params.get("logprobs")
        return replies.reply_bytes(tokens, self.n_choices,
                                   0 if logprobs is None else 1 + logprobs)

    @property
    def prompt_bound(self):
        """The most prompt tokens: the body's bytes plus a request's special tokens per
        prompt, at most a context window per prompt."""
        k = len(self.prompts)
        return min(self.body_bytes + TEMPLATE_TOKENS_PER_REQUEST * k,
                   self.entry.context_window * k)

    @property
    def echoed(self):
        """``{choice index: the prompt text it echoes}`` (choices are ordered by prompt, then
        by choice: OpenAI's order); empty without echo or for token prompts."""
        if not self.echo or self.token_prompts:
            return {}
        return {p * self.n + j: prompt for p, prompt in enumerate(self.prompts)
                for j in range(self.n)}

    @property
    def routing_messages(self):
        first = self.prompts[0]
        return [{"role": "user", "content": first}] if isinstance(first, str) else []

    def body_for(self, backend):
        """Return the body (dict) ``backend`` is sent: the prompts as given, the parameters
        its family reads, Kiln's cap in every length field it reads, usage asked for."""
        family = family_of(backend.server)
        out = {"model": backend.model, "prompt": _as_sent(self.prompts)}
        for name, value in self.params.items():
            if name in family.completion_params:
                out[name] = value
        out.update(self.extras)
        for name in family.completion_length_fields:
            out[name] = self.max_tokens
        out["stream"] = self.stream
        if self.stream:
            out["stream_options"] = family.stream_options
        return out


_COMPLETION_CHECKS = {
    "suffix": parameters._type(str, "a string"), "echo": parameters._type(bool, "a boolean"),
    "logprobs": parameters._int_in(0, MAX_LOGPROBS), "user": parameters._type(str, "a string"),
}


def validate_completion(body, catalog, body_bytes):
    """Check a completions ``body``; return a :class:`CompletionRequest`.

    :raises InvalidRequest: 400 naming the field; ``unsupported_endpoint`` for a model that
        does not serve completions.
    :raises ModelNotFound: 404.
    """
    entry = model_for(body, catalog, COMPLETIONS)
    if body_bytes > entry.context_window * MAX_BYTES_PER_TOKEN * MAX_PROMPTS:
        raise InvalidRequest(f"The request ({body_bytes} bytes) cannot fit the context window "
                             f"of model '{entry.id}'.", param="prompt",
                             code="context_length_exceeded")
    extras = _refuse_unknown(body, COMPLETION_PARAMETERS, entry)
    prompts, tokens = _prompts(body.get("prompt"), "prompt", entry, entry.context_window, True)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"Invalid 'prompt': at most {MAX_PROMPTS} prompts.",
                             param="prompt", code="invalid_value")
    _check_shapes(entry, prompts, tokens, "prompt")
    params = {k: v for k, v in body.items()
              if v is not None and COMPLETION_PARAMETERS.get(k) == FORWARD}
    for name, value in params.items():
        check = _COMPLETION_CHECKS.get(name) or parameters._CHECKS.get(name)
        if check is not None and name not in ("n",):
            check(value, name, entry)
    for name in ("suffix", "echo"):
        if params.get(name) not in (None, False) and not _family_reads(entry, name):
            raise UnsupportedParameter(f"'{name}' is not supported on model '{entry.id}' (its "
                                       f"model server does not read it): remove it.",
                                       param=name)
    stream = parameters._stream(body.get("stream"))
    echo = params.get("echo", False)
    n = _n(params.get("n", 1), entry)
    best_of = _best_of(params.get("best_of"), n, entry, stream)
    if best_of == n:
        params.pop("best_of", None)  # the same as none: generated and returned alike
    max_tokens = _completion_max_tokens(body.get("max_tokens"), entry, echo)
    _reply_tokens(max_tokens, n, best_of, len(prompts), params.get("logprobs") or 0, entry)
    return CompletionRequest(
        entry=entry, prompts=prompts, token_prompts=tokens, params=params, stream=stream,
        include_usage=parameters._stream_options(body.get("stream_options"), stream),
        stop=parameters.stop_strings(params.get("stop")),
        max_tokens=max_tokens, n=n,
        best_of=best_of, echo=echo, body_bytes=body_bytes, extras=extras)


def _reply_tokens(max_tokens, n, best_of, prompts, logprobs, entry):
    """Refuse an answer larger than the model allows: ``max_tokens × best_of × prompts × (1 +
    logprobs)`` token entries, chat's bound (docs/RELIABILITY.md, "Big answers")."""
    param = ("logprobs" if logprobs else "best_of" if best_of > n else "n" if n > 1
             else "prompt" if prompts > 1 else "max_tokens")
    replies.check_reply_tokens(
        entry, max_tokens * best_of * prompts, logprobs, param,
        f"max_tokens × best_of × prompts × (1 + logprobs) = {max_tokens} × {best_of} × "
        f"{prompts} × {1 + logprobs}")


def _completion_max_tokens(value, entry, echo):
    """The cap of one candidate: ``max_tokens``, else the model's max output; 0 only with
    ``echo`` (the prompt's logprobs, nothing generated)."""
    if value is None:
        return entry.max_output_tokens
    low = 0 if echo else 1
    if not is_int(value) or value < low:
        raise InvalidRequest(f"Invalid 'max_tokens': expected an integer of at least {low}"
                             f"{' (0 only with echo)' if not echo else ''}.",
                             param="max_tokens", code="invalid_value")
    if value > entry.max_output_tokens:
        raise InvalidRequest(f"Invalid 'max_tokens': {value} is above the model's maximum "
                             f"output of {entry.max_output_tokens} tokens.",
                             param="max_tokens", code="invalid_value")
    return value


def _n(value, entry):
    parameters._int_in(1, parameters.MAX_N)(value, "n", entry)
    if value > 1 and not _family_reads(entry, "n"):
        raise InvalidRequest(f"Unsupported value: 'n' must be 1 for model '{entry.id}' (its "
                             f"model server returns one choice per request); send several "
                             f"requests instead.", param="n", code="unsupported_value")
    return value


def _best_of(value, n, entry, stream):
    """``best_of`` candidates per prompt, at least ``n``, at most the catalog's bound; above
    ``n`` only where the family reads it and not in a stream (OpenAI cannot stream it)."""
    if value is None:
        return n
    parameters._int_in(1, entry.max_best_of)(value, "best_of", entry)
    if value < n:
        raise InvalidRequest("Invalid 'best_of': it must be at least 'n'.", param="best_of",
                             code="invalid_value")
    if value > n and stream:
        raise InvalidRequest("Invalid 'best_of': it cannot be above 'n' in a stream.",
                             param="best_of", code="invalid_value")
    if value > n and not _family_reads(entry, "best_of"):
        raise UnsupportedParameter(f"'best_of' above 'n' is not supported on model "
                                   f"'{entry.id}' (its model server does not read it).",
                                   param="best_of")
    return value


# -- embeddings -------------------------------------------------------------------------------

@dataclass
class EmbeddingsRequest:
    """A validated embeddings request: the inputs and how the vectors are written."""

    kind = EMBEDDINGS_ANSWER
    path = BACKEND_PATHS[EMBEDDINGS]

    entry: object
    inputs: list             # each a string or a list of token ids
    token_inputs: bool
    encoding_format: str     # what the client reads: "float" or "base64"
    dimensions: object       # int or None
    body_bytes: int
    stream: bool = False
    include_usage: bool = False
    stop: tuple = ()
    single_tool_call: bool = False
    has_images: bool = False
    max_tokens: int = 0
    n: int = 0
    extras: dict = field(default_factory=dict)
    response_headers: dict = field(default_factory=dict)

    completion_cap = 0       # nothing is generated: the hold is the input's bound alone
    reply_bound = None       # KILN_MAX_REPLY_BYTES alone bounds a reply of vectors

    @property
    def prompt_bound(self):
        """The most input tokens: the body's bytes plus a few special tokens per input, at
        most each input's limit."""
        k = len(self.inputs)
        return min(self.body_bytes + TEMPLATE_TOKENS_PER_MESSAGE * k,
                   self.entry.max_input_tokens * k)

    @property
    def routing_messages(self):
        return []

    def body_for(self, backend):
        """Return the body (dict) ``backend`` is sent: base64 asked for only where the family
        answers it (Kiln encodes the floats of the others)."""
        family = family_of(backend.server)
        out = {"model": backend.model, "input": _as_sent(self.inputs),
               "encoding_format": "base64" if self.encoding_format == "base64"
               and family.base64_embeddings else "float"}
        if self.dimensions is not None:
            out["dimensions"] = self.dimensions
        out.update(self.extras)
        return out


def validate_embeddings(body, catalog, body_bytes):
    """Check an embeddings ``body``; return an :class:`EmbeddingsRequest`.

    :raises InvalidRequest: 400 naming the field (too many inputs, an input above its token
        limit, ``dimensions`` on a model that does not read it, ``stream``: there is none).
    :raises ModelNotFound: 404.
    """
    entry = model_for(body, catalog, EMBEDDINGS)
    extras = _refuse_unknown(body, EMBEDDING_PARAMETERS, entry)
    inputs, tokens = _prompts(body.get("input"), "input", entry, entry.max_input_tokens, False)
    if len(inputs) > entry.embedding_max_inputs:
        raise InvalidRequest(f"Invalid 'input': {len(inputs)} inputs are more than the "
                             f"{entry.embedding_max_inputs} model '{entry.id}' takes in one "
                             f"request.", param="input", code="invalid_value")
    _check_shapes(entry, inputs, tokens, "input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise InvalidRequest("Invalid 'encoding_format': expected one of float, base64.",
                             param="encoding_format", code="invalid_value")
    if body.get("user") is not None:
        parameters._type(str, "a string")(body["user"], "user", entry)
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not is_int(dimensions) or dimensions < 1:
            raise InvalidRequest("Invalid 'dimensions': expected an integer of at least 1.",
                                 param="dimensions", code="invalid_value")
        if not entry.dimensions:
            raise UnsupportedParameter(f"'dimensions' is not supported on model '{entry.id}': "
                                       f"remove it.", param="dimensions")
    return EmbeddingsRequest(entry=entry, inputs=inputs, token_inputs=tokens,
                             encoding_format=fmt or "float", dimensions=dimensions,
                             body_bytes=body_bytes, extras=extras)
