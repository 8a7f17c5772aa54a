"""Tools in a request: ``tools``, ``tool_choice``, ``parallel_tool_calls``, the deprecated
``functions`` / ``function_call`` (rewritten into tools), and the tool calls of assistant
messages sent back (docs/PARAMETERS.md, ``tools`` and "Messages")."""
from ..errors import InvalidRequest, UnsupportedParameter, refuse_unknown_keys

# The keys of a tool call sent back in an assistant message, and of its function (the openai
# SDK's ``ChatCompletionMessageFunctionToolCallParam``); Kiln sends these and nothing else.
CALL_KEYS = ("id", "type", "function")
FUNCTION_CALL_KEYS = ("name", "arguments")
# The keys of a function tool and of its definition (``ChatCompletionFunctionToolParam``,
# ``FunctionDefinition``), of a deprecated ``functions`` entry, and of a named tool choice.
TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
DEPRECATED_FUNCTION_KEYS = ("name", "description", "parameters")
TOOL_CHOICE_KEYS = ("type", "function")


def check_tools(tools):
    """Check ``tools``: function tools, each with a name and a description (docs/PARAMETERS.md)."""
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
        refuse_unknown_keys(tool, TOOL_KEYS, where)
        _function_definition(tool.get("function"), f"{where}.function", FUNCTION_KEYS)


def _function_definition(function, where, keys):
    if not isinstance(function, dict):
        raise InvalidRequest(f"Missing required parameter: '{where}'.", param=where,
                             code="missing_required_parameter")
    refuse_unknown_keys(function, keys, where)
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequest(f"Invalid '{where}.strict': expected a boolean.",
                             param=f"{where}.strict", code="invalid_type")
    for field in ("name", "description"):
        value = function.get(field)
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequest(f"Invalid '{where}.{field}': a non-empty string is required.",
                                 param=f"{where}.{field}", code="missing_required_parameter")
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise InvalidRequest(f"Invalid '{where}.parameters': expected a JSON Schema object.",
                             param=f"{where}.parameters", code="invalid_type")


def rewrite_functions(body, params):
    """Rewrite the deprecated ``functions`` / ``function_call`` into ``tools`` / ``tool_choice``."""
    functions, call = body.get("functions"), body.get("function_call")
    if functions is None and call is None:
        return
    if params.get("tools") is not None or params.get("tool_choice") is not None:
        raise InvalidRequest("Send either 'tools' or the deprecated 'functions', not both.",
                             param="functions", code="invalid_value")
    if functions is not None:
        if not isinstance(functions, list):
            raise InvalidRequest("Invalid 'functions': expected an array.", param="functions",
                                 code="invalid_type")
        for i, function in enumerate(functions):
            _function_definition(function, f"functions[{i}]", DEPRECATED_FUNCTION_KEYS)
        params["tools"] = [{"type": "function", "function": f} for f in functions]
    if call is not None:
        if call in ("auto", "none"):
            params["tool_choice"] = call
        elif isinstance(call, dict) and isinstance(call.get("name"), str):
            params["tool_choice"] = {"type": "function", "function": {"name": call["name"]}}
        else:
            raise InvalidRequest("Invalid 'function_call': expected 'auto', 'none' or "
                                 "{\"name\": ...}.", param="function_call", code="invalid_value")


def check_tool_calls(calls, where):
    """Check an assistant message's ``tool_calls``: function calls of the keys OpenAI allows
    (docs/PARAMETERS.md, "Messages")."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"Invalid '{where}': expected an array.", param=where,
                             code="invalid_type")
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("id"), str):
            raise InvalidRequest(f"Invalid '{where}[{i}]': expected a tool call with an 'id'.",
                                 param=f"{where}[{i}]", code="invalid_type")
        if call.get("type", "function") != "function":  # Kiln's tools are functions only
            raise InvalidRequest(f"Invalid '{where}[{i}].type': only 'function' tool calls are "
                                 f"supported.", param=f"{where}[{i}].type", code="invalid_value")
        check_function_call(call.get("function"), f"{where}[{i}].function")
        refuse_unknown_keys(call, CALL_KEYS, f"{where}[{i}]")


def check_function_call(function, where):
    """Check a function call: ``{"name": str, "arguments": str}``, no other key."""
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments", ""), str)):
        raise InvalidRequest(f"Invalid '{where}': expected an object with a 'name' and string "
                             f"'arguments'.", param=where, code="invalid_type")
    refuse_unknown_keys(function, FUNCTION_CALL_KEYS, where)


def check_tool_choice(choice, entry, tools=None):
    """Check ``tool_choice`` against the model and ``tools`` (already checked): a named
    function must be one of them."""
    if choice is None or choice in ("auto", "none"):
        return
    forced = choice == "required" or (
        isinstance(choice, dict) and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str))
    if not forced:
        raise InvalidRequest("Invalid 'tool_choice': expected 'auto', 'none', 'required' or "
                             "a named function.", param="tool_choice", code="invalid_value")
    if isinstance(choice, dict):
        refuse_unknown_keys(choice, TOOL_CHOICE_KEYS, "tool_choice")
        refuse_unknown_keys(choice["function"], ("name",), "tool_choice.function")
    if not entry.forced_tool_choice:
        # Such a model answers a silent 500 or empty arguments; refuse clearly instead
        # (docs/PARAMETERS.md, ``tool_choice``).
        raise UnsupportedParameter(f"Forced tool choice is not supported on model "
                                   f"'{entry.id}': send tool_choice \"auto\".",
                                   param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise InvalidRequest(f"Invalid 'tool_choice': no function named '{name[:100]}' in "
                                 f"'tools'.", param="tool_choice.function.name",
                                 code="invalid_value")


def named_as_required(choice, tools):
    """The ``tool_choice`` and ``tools`` that force the call ``choice`` names on a server that
    reads no named choice: "required", with that function the only tool (OpenAI's named choice
    forces a call of that function; "required" forces a call of one of ``tools``)."""
    name = choice["function"]["name"]
    return {"tool_choice": "required",
            "tools": [t for t in tools if t["function"]["name"] == name]}


def parallel_tool_calls(body, entry, params):
    """Return whether Kiln keeps only the first tool call itself (the model ignores the flag)."""
    value = body.get("parallel_tool_calls")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest("Invalid 'parallel_tool_calls': expected a boolean.",
                             param="parallel_tool_calls", code="invalid_type")
    if entry.parallel_tool_calls:
        params["parallel_tool_calls"] = value
        return False
    return value is False
