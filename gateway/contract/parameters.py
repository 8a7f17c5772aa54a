"""The request's parameters other than ``messages``: what a client may send, and the body Kiln
builds for each backend from it (:func:`upstream_body`).

Every parameter of the current OpenAI chat API and of the model servers Kiln fronts has one row in
:data:`PARAMETERS`: Kiln writes it itself, forwards it to the backend families that read it,
accepts and drops it, or refuses it; docs/PARAMETERS.md is the same table in prose. Any other
top-level field is refused (400, ``param`` naming it) unless the model's catalog entry allows it
by name (``extra_params``). Length is Kiln's: a backend is sent the cap Kiln held for, in the
fields its family reads, so no backend generates more than the customer pays for (README,
"What Kiln does beyond passing requests through").
"""
from ..errors import InvalidRequest, UnknownParameter, UnsupportedParameter
from . import replies, tools
from .families import family_of

# Enumerated values as the current OpenAI chat API lists them (the openai SDK's
# ``completion_create_params``); tests/unit/contract/test_parameters.py checks them against the SDK.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
VERBOSITIES = ("low", "medium", "high")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
PROMPT_CACHE_OPTIONS = {"mode": ("implicit", "explicit"), "ttl": ("30m",)}
RANGES = {"temperature": (0, 2), "top_p": (0, 1),
          "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2)}
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_N = 128  # OpenAI's bound on choices
INT64 = 2 ** 63
# Length fields a client may send; the smallest wins, and none is forwarded as given.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_new_tokens")

KILN, FORWARD, DROP, REFUSE = "rewritten", "forwarded", "dropped", "refused"
# What Kiln does with each request field. KILN: Kiln writes the field itself (from what the
# client sent, never as sent); FORWARD: sent to the families that read it
# (gateway.contract.families), dropped for the others.
PARAMETERS = {
    "model": KILN, "messages": KILN, "stream": KILN, "stream_options": KILN,
    "max_tokens": KILN, "max_completion_tokens": KILN, "n_predict": KILN,
    "max_new_tokens": KILN, "parallel_tool_calls": KILN, "functions": KILN,
    "function_call": KILN,
    "temperature": FORWARD, "top_p": FORWARD, "presence_penalty": FORWARD,
    "frequency_penalty": FORWARD, "seed": FORWARD, "n": FORWARD, "stop": FORWARD,
    "logit_bias": FORWARD, "logprobs": FORWARD, "top_logprobs": FORWARD, "tools": FORWARD,
    "tool_choice": FORWARD, "response_format": FORWARD, "reasoning_effort": FORWARD,
    "ignore_eos": FORWARD, "min_tokens": FORWARD,
    "user": DROP, "metadata": DROP, "store": DROP, "service_tier": DROP,
    "prompt_cache_key": DROP, "prompt_cache_retention": DROP, "safety_identifier": DROP,
    "verbosity": DROP, "modalities": DROP, "prediction": DROP, "prompt_cache_options": DROP,
    "audio": REFUSE, "web_search_options": REFUSE, "moderation": REFUSE,
}


def check(body, entry):
    """Check every parameter of ``body`` but ``model`` and ``messages`` for ``entry``.

    :returns: the :class:`gateway.contract.validation.ChatRequest` fields they decide: ``params``,
        ``extras``, ``stream``, ``include_usage``, ``stop``, ``single_tool_call``,
        ``max_tokens``, ``n``.
    :raises InvalidRequest: 400 naming the field (``unknown_parameter``, ``invalid_type``,
        ``invalid_value``, ``unsupported_parameter``).
    """
    extras = _unknown_fields(body, entry)
    params = {k: v for k, v in body.items()
              if v is not None and PARAMETERS.get(k) not in (None, KILN)}
    for name in params:
        _CHECKS.get(name, _no_check)(params[name], name, entry)
    if params.get("top_logprobs") is not None and params.get("logprobs") is not True:
        raise InvalidRequest("Invalid 'top_logprobs': it needs 'logprobs' set to true.",
                             param="top_logprobs", code="invalid_value")
    tools.rewrite_functions(body, params)
    tools.check_tools(params.get("tools"))
    tools.check_tool_choice(params.get("tool_choice"), entry, params.get("tools"))
    stream = _stream(body.get("stream"))
    cap = _max_tokens(body, entry)
    _min_tokens(params.get("min_tokens"), cap)
    _reply_tokens(params, cap, entry)
    return {"params": params, "extras": extras, "stream": stream,
            "include_usage": _stream_options(body.get("stream_options"), stream),
            "stop": stop_strings(params.get("stop")),
            "single_tool_call": tools.parallel_tool_calls(body, entry, params),
            "max_tokens": cap, "n": params.get("n", 1)}


def _unknown_fields(body, entry):
    extras = {}
    for name, value in body.items():
        if name in PARAMETERS:
            if PARAMETERS[name] == REFUSE and value is not None:
                raise UnsupportedParameter(f"'{name}' is not supported by Kiln's models: "
                                           f"remove it.", param=name)
        elif name in entry.extra_params:
            extras[name] = value
        else:
            # OpenAI's answer to a field it does not know; nothing unknown reaches a backend.
            raise UnknownParameter(name[:100], f"Unrecognized request argument supplied: "
                                               f"{name[:100]}")
    return extras


def upstream_body(chat, backend):
    """Return the body (dict) to send ``backend`` for ``chat``: only what Kiln decided.

    ``model`` is the backend's; messages are rewritten into shapes the backend's family reads;
    parameters go to the families that read them; length is the cap Kiln held for, in every
    length field the family reads; streams always ask for usage.

    :param chat: :class:`gateway.contract.validation.ChatRequest`.
    :param backend: :class:`gateway.contract.catalog.Backend` (its ``server`` names the family).
    """
    family = family_of(backend.server)
    out = {"model": backend.model, "messages": family.messages(chat.messages)}
    for name, value in chat.params.items():
        if name in family.params and PARAMETERS[name] == FORWARD:
            out[name] = value
    out.update(chat.extras)
    if isinstance(out.get("tool_choice"), dict) and not family.named_tool_choice:
        out.update(tools.named_as_required(out["tool_choice"], out["tools"]))
    if "parallel_tool_calls" in chat.params:  # only where the model honours it
        out["parallel_tool_calls"] = chat.params["parallel_tool_calls"]
    for name in family.length_fields:
        out[name] = chat.max_tokens
    out["stream"] = chat.stream
    if chat.stream:
        out["stream_options"] = family.stream_options
    return out


# -- checks of single parameters ------------------------------------------------------------

def _no_check(value, name, entry):
    pass


def _number_in_range(value, name, entry):
    low, high = RANGES[name]
    if not is_number(value) or not low <= value <= high:
        raise InvalidRequest(f"Invalid '{name}': expected a number from {low} to {high}.",
                             param=name, code="invalid_value")


def _type(kind, label):
    def check_type(value, name, entry):
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise InvalidRequest(f"Invalid '{name}': expected {label}.", param=name,
                                 code="invalid_type")
    return check_type


def _one_of(values):
    def check_value(value, name, entry):
        if value not in values:
            raise InvalidRequest(f"Invalid '{name}': expected one of {', '.join(values)}.",
                                 param=name, code="invalid_value")
    return check_value


def _int_in(low, high):
    def check_int(value, name, entry):
        if not is_int(value) or not low <= value <= high:
            raise InvalidRequest(f"Invalid '{name}': expected an integer from {low} to {high}.",
                                 param=name, code="invalid_value")
    return check_int


def _n(value, name, entry):
    _int_in(1, MAX_N)(value, name, entry)
    if value > 1 and any("n" not in family_of(b.server).params for b in entry.backends):
        # llama.cpp's server refuses n > 1 and llama-cpp-python's answers one choice: the
        # client would pay for a hold of n choices and get one.
        raise InvalidRequest(f"Unsupported value: 'n' must be 1 for model '{entry.id}' (its "
                             f"model server returns one choice per request); send several "
                             f"requests instead.", param=name, code="unsupported_value")


def _logit_bias(value, name, entry):
    _type(dict, "an object")(value, name, entry)
    for token, bias in value.items():
        if not token.isdigit() or not is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"Invalid 'logit_bias': keys are token ids and biases numbers "
                                 f"from -100 to 100 ({token[:20]!r}).", param="logit_bias",
                                 code="invalid_value")


def _metadata(value, name, entry):
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidRequest("Invalid 'metadata': expected an object of strings.",
                             param=name, code="invalid_type")


def _modalities(value, name, entry):
    if not isinstance(value, list) or not all(m in ("text", "audio") for m in value):
        raise InvalidRequest("Invalid 'modalities': expected an array of 'text' and 'audio'.",
                             param=name, code="invalid_value")
    if "audio" in value:
        raise UnsupportedParameter("Audio output is not supported: send modalities "
                                   "[\"text\"].", param=name)


def _ignore_eos(value, name, entry):
    _type(bool, "a boolean")(value, name, entry)
    if value and entry.family == "gpt-oss":  # docs/PARAMETERS.md, ``ignore_eos``
        raise UnsupportedParameter("ignore_eos is not supported on gpt-oss models: remove it.",
                                   param="ignore_eos")


def _response_format(fmt, name, entry):
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind not in ("json_object", "json_schema"):
        raise InvalidRequest("Invalid 'response_format.type': expected text, json_object or "
                             "json_schema.", param="response_format", code="invalid_value")
    if not entry.response_format:
        # Such a model answers 200 with empty content; refuse clearly instead
        # (docs/PARAMETERS.md, ``response_format``).
        raise UnsupportedParameter(f"response_format {kind} is not supported on model "
                                   f"'{entry.id}': ask for JSON in the prompt instead.",
                                   param="response_format")
    if kind == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
        raise InvalidRequest("Invalid 'response_format.json_schema': expected an object.",
                             param="response_format.json_schema", code="invalid_type")


def _prediction(value, name, entry):
    if not isinstance(value, dict) or value.get("type") != "content":
        raise InvalidRequest("Invalid 'prediction': expected {\"type\": \"content\", ...}.",
                             param=name, code="invalid_value")


def _prompt_cache_options(value, name, entry):
    _type(dict, "an object")(value, name, entry)
    for key, item in value.items():
        if key not in PROMPT_CACHE_OPTIONS:
            raise UnknownParameter(f"{name}.{key[:100]}")
        _one_of(PROMPT_CACHE_OPTIONS[key])(item, f"{name}.{key}", entry)


def _seed(value, name, entry):
    if not is_int(value):
        raise InvalidRequest("Invalid 'seed': expected an integer.", param=name,
                             code="invalid_type")
    _int_in(-INT64, INT64 - 1)(value, name, entry)


_STRING = _type(str, "a string")
_BOOL = _type(bool, "a boolean")
_CHECKS = {
    **{name: _number_in_range for name in RANGES},
    "seed": _seed, "n": _n,
    "top_logprobs": _int_in(0, MAX_TOP_LOGPROBS), "logprobs": _BOOL, "logit_bias": _logit_bias,
    "reasoning_effort": _one_of(REASONING_EFFORTS), "response_format": _response_format,
    "ignore_eos": _ignore_eos, "min_tokens": _int_in(0, INT64 - 1),
    "user": _STRING, "prompt_cache_key": _STRING, "safety_identifier": _STRING,
    "prompt_cache_retention": _one_of(PROMPT_CACHE_RETENTIONS), "metadata": _metadata,
    "store": _BOOL, "prompt_cache_options": _prompt_cache_options,
    "service_tier": _one_of(SERVICE_TIERS), "verbosity": _one_of(VERBOSITIES),
    "modalities": _modalities, "prediction": _prediction,
}


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


# -- stream and length ------------------------------------------------------------------------

def _stream(value):
    """Read ``stream`` as docs/PARAMETERS.md says: ``true``, ``"true"``, ``1`` are true; ``false``,
    ``"false"``, ``0``, ``null`` are false; nothing else (not ``"1"``, ``1.0``, ``"True"``)."""
    integer = is_int(value)
    if value is True or value == "true" or (integer and value == 1):
        return True
    if value is False or value is None or value == "false" or (integer and value == 0):
        return False
    code = "invalid_value" if isinstance(value, str) or integer else "invalid_type"
    raise InvalidRequest("Invalid 'stream': expected true or false (also \"true\", \"false\", "
                         "1 or 0).", param="stream", code=code)


STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def _stream_options(options, stream):
    """Return whether the client asked for the usage chunk. Kiln asks every backend for usage
    itself; ``include_obfuscation`` is accepted and dropped."""
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("Invalid 'stream_options': only allowed when 'stream' is true.",
                             param="stream_options", code="invalid_value")
    if not isinstance(options, dict):
        raise InvalidRequest("Invalid 'stream_options': expected an object.",
                             param="stream_options", code="invalid_type")
    for name, value in options.items():
        if name not in STREAM_OPTIONS:
            raise UnknownParameter(f"stream_options.{name[:100]}",
                                   f"Unrecognized stream option: {name[:100]}")
        if not isinstance(value, bool):
            raise InvalidRequest(f"Invalid 'stream_options.{name}': expected a boolean.",
                                 param=f"stream_options.{name}", code="invalid_type")
    return options.get("include_usage", False)


def _max_tokens(body, entry):
    """Return the completion cap of one choice: the smallest length field sent, else the
    model's max output."""
    cap = entry.max_output_tokens
    for name in LENGTH_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise InvalidRequest(f"Invalid '{name}': expected an integer of at least 1.",
                                 param=name, code="invalid_value")
        if value > entry.max_output_tokens:
            raise InvalidRequest(f"Invalid '{name}': {value} is above the model's maximum "
                                 f"output of {entry.max_output_tokens} tokens.", param=name,
                                 code="invalid_value")
        cap = min(cap, value)
    return cap


def _reply_tokens(params, cap, entry):
    """Refuse an answer larger than the model allows: ``n × max_tokens × (1 + top_logprobs)``
    token entries (docs/RELIABILITY.md, "Big answers"). The field named is the one that
    multiplies most: ``top_logprobs``, else ``n``, else ``max_tokens``."""
    n, alternatives = params.get("n", 1), logprob_alternatives(params)
    param = "top_logprobs" if alternatives else "n" if n > 1 else "max_tokens"
    replies.check_reply_tokens(
        entry, n * cap, alternatives, param,
        f"n × max_tokens × (1 + top_logprobs) = {n} × {cap} × {1 + alternatives}")


def logprob_alternatives(params):
    """``top_logprobs`` asked for (0 without ``logprobs``)."""
    return (params.get("top_logprobs") or 0) if params.get("logprobs") is True else 0


def _min_tokens(value, cap):
    if value is not None and value > cap:
        raise InvalidRequest(f"Invalid 'min_tokens': {value} is above the completion cap of "
                             f"{cap} tokens (max_tokens).", param="min_tokens",
                             code="invalid_value")


def stop_strings(stop):
    """Return the stop strings as a tuple (Kiln enforces them on the output)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequest("Invalid 'stop': expected a non-empty string or an array of up to "
                             "4 non-empty strings.", param="stop", code="invalid_value")
    return tuple(stop)


_CHECKS["stop"] = lambda value, name, entry: stop_strings(value)
