"""Checks of the request's parameters other than ``messages`` (``validation`` runs them).

Types, ranges and enums as the endpoint reference gives them; parameters a model cannot honour
are refused (``unsupported_parameter``) instead of the silent failures the reference documents.
"""
from .errors import InvalidRequest, UnsupportedParameter

REASONING_EFFORTS = ("low", "medium", "high")
RANGES = {"temperature": (0, 2), "top_p": (0, 1),
          "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2)}
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_N = 128  # OpenAI's bound on choices


def check_tools(tools):
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("Invalid 'tools': expected an array.", param="tools",
                             code="invalid_type")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"Invalid '{where}.type': only 'function' tools are supported.",
                                 param=f"{where}.type", code="invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"Missing required parameter: '{where}.function'.",
                                 param=f"{where}.function", code="missing_required_parameter")
        for field in ("name", "description"):
            value = function.get(field)
            if not isinstance(value, str) or not value.strip():
                raise InvalidRequest(f"Invalid '{where}.function.{field}': a non-empty string is "
                                     f"required.", param=f"{where}.function.{field}",
                                     code="missing_required_parameter")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise InvalidRequest(f"Invalid '{where}.function.parameters': expected a JSON "
                                 f"Schema object.", param=f"{where}.function.parameters",
                                 code="invalid_type")


def check_tool_choice(choice, entry):
    if choice is None or choice in ("auto", "none"):
        return
    forced = choice == "required" or (
        isinstance(choice, dict) and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str))
    if not forced:
        raise InvalidRequest("Invalid 'tool_choice': expected 'auto', 'none', 'required' or "
                             "a named function.", param="tool_choice", code="invalid_value")
    if not entry.forced_tool_choice:
        # The reference documents a silent 500 / empty arguments here; refuse clearly instead.
        raise UnsupportedParameter(f"Forced tool choice is not supported on model "
                                   f"'{entry.id}': send tool_choice \"auto\".",
                                   param="tool_choice")


def parallel_tool_calls(body, entry, forward):
    value = body.get("parallel_tool_calls")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest("Invalid 'parallel_tool_calls': expected a boolean.",
                             param="parallel_tool_calls", code="invalid_type")
    if entry.parallel_tool_calls:
        return False
    # Not honoured by this model's server: Kiln keeps only the first tool call itself.
    del forward["parallel_tool_calls"]
    return value is False


def check_enums_and_ranges(body):
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest("Invalid 'reasoning_effort': expected low, medium or high.",
                             param="reasoning_effort", code="invalid_value")
    for name, (low, high) in RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if not is_number(value) or not low <= value <= high:
            raise InvalidRequest(f"Invalid '{name}': expected a number from {low} to {high}.",
                                 param=name, code="invalid_value")
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise InvalidRequest("Invalid 'seed': expected an integer.", param="seed",
                             code="invalid_type")
    _logprobs(body)
    for name, kind in (("user", str), ("metadata", dict), ("logit_bias", dict)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise InvalidRequest(f"Invalid '{name}': expected "
                                 f"{'a string' if kind is str else 'an object'}.", param=name,
                                 code="invalid_type")
    for token, bias in (body.get("logit_bias") or {}).items():
        if not is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"Invalid 'logit_bias': the bias of token {token[:20]!r} must "
                                 f"be a number from -100 to 100.", param="logit_bias",
                                 code="invalid_value")


def _logprobs(body):
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest("Invalid 'logprobs': expected a boolean.", param="logprobs",
                             code="invalid_type")
    if top is None:
        return
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"Invalid 'top_logprobs': expected an integer from 0 to "
                             f"{MAX_TOP_LOGPROBS}.", param="top_logprobs", code="invalid_value")
    if logprobs is not True:
        raise InvalidRequest("Invalid 'top_logprobs': it needs 'logprobs' set to true.",
                             param="top_logprobs", code="invalid_value")


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def n_choices(body):
    n = _positive_int(body, "n") or 1
    if n > MAX_N:
        raise InvalidRequest(f"Invalid 'n': at most {MAX_N} choices.", param="n",
                             code="invalid_value")
    return n


def _positive_int(body, name):
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise InvalidRequest(f"Invalid '{name}': expected an integer of at least 1.",
                             param=name, code="invalid_value")
    return value


def max_tokens(body, entry):
    cap = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = _positive_int(body, name)
        if value is not None and value > entry.max_output_tokens:
            raise InvalidRequest(f"Invalid '{name}': {value} is above the model's maximum "
                                 f"output of {entry.max_output_tokens} tokens.", param=name,
                                 code="invalid_value")
        cap = value if cap is None else min(cap, value or cap)
    return cap


def stop_strings(stop):
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequest("Invalid 'stop': expected a non-empty string or an array of up to "
                             "4 non-empty strings.", param="stop", code="invalid_value")
    return tuple(stop)


def check_response_format(fmt, entry):
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind not in ("json_object", "json_schema"):
        raise InvalidRequest("Invalid 'response_format.type': expected text, json_object or "
                             "json_schema.", param="response_format", code="invalid_value")
    if not entry.response_format:
        # The reference documents 200 with empty content here; refuse clearly instead.
        raise UnsupportedParameter(f"response_format {kind} is not supported on model "
                                   f"'{entry.id}': ask for JSON in the prompt instead.",
                                   param="response_format")
