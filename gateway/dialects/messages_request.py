"""The request side of ``POST /v1/messages``: an Anthropic Messages body becomes an OpenAI chat
body, which the chat contract then validates (:func:`gateway.contract.validation.validate_chat`),
so every check of chat (model, capabilities, tools, images, length) holds here too.

The fields and blocks follow Anthropic's Messages API reference
(https://docs.claude.com/en/api/messages) as the official ``anthropic`` SDK types it
(``MessageCreateParams``, ``ContentBlockParam``, ``ToolParam``); docs/MESSAGES.md is the
field-by-field table. Anthropic refuses a field outside its reference ("Extra inputs are not
permitted"); so does Kiln, and every field of the reference is accepted: mapped, or accepted and
dropped where a self-hosted model has nothing to do with it. Errors name the field at fault in
Anthropic's terms (``messages.0.content.1.source``), also when the chat contract finds it.
"""
import json
import re

from ..errors import GatewayError, InvalidRequest, UnsupportedParameter
from ..flow.metering import estimate_prompt
from ..contract.validation import validate_chat

MAPPED, DROPPED, REFUSED = "mapped", "dropped", "refused"
# Every top-level field of a Messages request: the SDK's ``MessageCreateParamsBase``, ``stream``,
# and the sampling fields the API reference still documents for the models that take them
# (``temperature``, ``top_p``, ``top_k``), which clients send. tests/unit/dialects checks the set
# against the installed SDK.
FIELDS = {
    "model": MAPPED, "max_tokens": MAPPED, "messages": MAPPED, "system": MAPPED,
    "stop_sequences": MAPPED, "stream": MAPPED, "temperature": MAPPED, "top_p": MAPPED,
    "top_k": MAPPED, "tools": MAPPED, "tool_choice": MAPPED, "thinking": MAPPED,
    "metadata": MAPPED, "output_config": MAPPED,
    "service_tier": DROPPED, "cache_control": DROPPED, "container": DROPPED,
    "diagnostics": DROPPED, "inference_geo": DROPPED, "speed": DROPPED,
    "user_profile_id": DROPPED, "workspace_id": DROPPED,
}
LEGACY_SAMPLING = ("temperature", "top_p", "top_k")
# ``POST /v1/messages/count_tokens`` takes the request without its generation settings
# (the SDK's ``MessageCountTokensParams``).
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking",
                "output_config", "cache_control", "speed", "user_profile_id", "workspace_id")

# Keys of each block a client may send (the SDK's ``*BlockParam`` types), and what becomes of
# the block. Blocks Kiln's models cannot take are refused by name, never dropped silently.
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "image": {"type", "source", "cache_control", "transformations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control",
                    "toolset_name"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
ROLE_BLOCKS = {"user": {"text", "image", "tool_result"},
               "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
               "system": {"text"}}
TOOL_RESULT_BLOCKS = {"text", "image"}
# Block types of the reference that Kiln refuses, with the reason told to the client.
UNSUPPORTED_BLOCKS = {
    "document": "document blocks (PDF or text documents) are not supported by Kiln's models; "
                "send the document's text in a text block",
    "search_result": "search_result blocks are not supported by Kiln's models; send the "
                     "results as text",
    "container_upload": "container_upload blocks need Anthropic's code execution container",
    "tool_reference": "tool_reference blocks need Anthropic's tool search",
    "browser_state": "browser_state blocks need Anthropic's browser toolset",
}
SERVER_TOOL_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                      "code_execution_tool_result", "bash_code_execution_tool_result",
                      "text_editor_code_execution_tool_result", "tool_search_tool_result")
for _kind in SERVER_TOOL_BLOCKS:
    UNSUPPORTED_BLOCKS[_kind] = (f"{_kind} blocks are the results of Anthropic's server tools, "
                                 f"which Kiln's models do not run")
MESSAGE_KEYS = {"role", "content"}
CUSTOM_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict",
                    "allowed_callers", "defer_loading", "eager_input_streaming",
                    "input_examples"}
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
CACHE_CONTROL_KEYS = {"type", "ttl"}
CACHE_TTLS = ("5m", "1h")
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
THINKING_KEYS = {"enabled": {"type", "budget_tokens", "display"},
                 "disabled": {"type"}, "adaptive": {"type", "display"},
                 "between_tools": {"type"}}
THINKING_DISPLAYS = ("summarized", "omitted")
MIN_THINKING_BUDGET = 1024  # the API reference: budget_tokens >= 1024 and < max_tokens
EFFORTS = ("low", "medium", "high", "xhigh", "max")
SERVICE_TIERS = ("auto", "standard_only")
SPEEDS = ("standard", "fast")
# Model families (catalog ``family``) whose chat template reads OpenAI's ``reasoning_effort``;
# elsewhere thinking settings are accepted and dropped (docs/MESSAGES.md, ``thinking``).
REASONING_EFFORT_FAMILIES = ("gpt-oss",)
# A thinking budget, in tokens, becomes the first effort whose bound it is under.
EFFORT_BY_BUDGET = ((4096, "low"), (16384, "medium"), (None, "high"))
# Kiln enforces stop strings itself, and its chat contract (and OpenAI's) takes at most 4.
MAX_STOP_SEQUENCES = 4
TOOL_ERROR_PREFIX = "[tool error] "
# The header saying max_tokens was lowered to the model's maximum output: "asked->held".
MAX_TOKENS_LOWERED_HEADER = "X-Kiln-Max-Tokens-Lowered"


def extra_input(param):
    """Anthropic's refusal of a field outside its reference."""
    return InvalidRequest(f"{param}: Extra inputs are not permitted", param=param,
                          code="unknown_parameter")


def _invalid(param, message, code="invalid_value"):
    return InvalidRequest(f"{param}: {message}", param=param, code=code)


def _refuse_extra(obj, allowed, where):
    for key in obj:
        if key not in allowed:
            raise extra_input(f"{where}.{str(key)[:100]}" if where else str(key)[:100])


def _object(value, param):
    if not isinstance(value, dict):
        raise _invalid(param, "Input should be an object", "invalid_type")
    return value


def _string(value, param, *, empty=True):
    if not isinstance(value, str) or (not empty and not value):
        raise _invalid(param, "Input should be a non-empty string" if not empty
                       else "Input should be a valid string", "invalid_type")
    return value


def _int(value, param, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _invalid(param, f"Input should be an integer of at least {low}")
    return value


def _number(value, param, low, high):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _invalid(param, f"Input should be a number from {low} to {high}")
    return value


def _one_of(value, values, param):
    if value not in values:
        raise _invalid(param, f"Input should be one of {', '.join(values)}")
    return value


def _cache_control(value, param):
    if value is None:
        return
    _refuse_extra(_object(value, param), CACHE_CONTROL_KEYS, param)
    _one_of(value.get("type"), ("ephemeral",), f"{param}.type")
    if value.get("ttl") is not None:
        _one_of(value["ttl"], CACHE_TTLS, f"{param}.ttl")


class Translation:
    """One Messages body as an OpenAI chat body, and where each chat path came from.

    :attr:`chat` is the chat body; :meth:`rename` turns an error of the chat contract, which
    names OpenAI paths (``messages[2].content[0].image_url``), into Anthropic's
    (``messages.1.content.0.source``).
    """

    def __init__(self):
        self.chat = {}
        self.headers = {}
        self.origins = []     # per chat message: (path, [block path per part], [per tool call])
        self.tool_paths = []  # per chat tool: the Anthropic tools.i path
        self.top = {"stop": "stop_sequences", "user": "metadata.user_id",
                    "reasoning_effort": "thinking", "response_format": "output_config.format",
                    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}

    def rename(self, err):
        """Return ``err`` with its ``param`` (and the message quoting it) in Anthropic's terms."""
        old = err.param
        new = self._path(old) if isinstance(old, str) else None
        if new and new != old:
            err.param = new
            err.message = err.message.replace(f"'{old}'", f"'{new}'")
        return err

    _MESSAGE = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?(?:\.tool_calls\[(\d+)\])?"
                          r"(.*)$")
    _TOOL = re.compile(r"tools\[(\d+)\](.*)$")

    def _path(self, param):
        match = self._MESSAGE.match(param)
        if match and int(match.group(1)) < len(self.origins):
            path, parts, calls = self.origins[int(match.group(1))]
            part, call, rest = match.group(2), match.group(3), match.group(4)
            if part is not None and int(part) < len(parts):
                path, rest = parts[int(part)], re.sub(r"^\.image_url.*", ".source", rest)
            elif call is not None and int(call) < len(calls):
                path = calls[int(call)]
                rest = {".function.arguments": ".input", ".function.name": ".name"}.get(rest, "")
            elif part is not None or call is not None:
                rest = ""
            kept = ("", ".source", ".input", ".name", ".text", ".content")
            return path + (rest if rest in kept else "")
        match = self._TOOL.match(param)
        if match and int(match.group(1)) < len(self.tool_paths):
            rest = {".function.parameters": ".input_schema", ".function.name": ".name",
                    ".function.description": ".description",
                    ".function.strict": ".strict"}.get(match.group(2), "")
            return self.tool_paths[int(match.group(1))] + rest
        if param.startswith("tool_choice"):
            return "tool_choice"
        return self.top.get(param, param)


def translate(body, catalog, fields=FIELDS):
    """Return the :class:`Translation` of the Messages ``body`` (dict).

    :param fields: the top-level fields the endpoint takes (``count_tokens`` takes fewer).
    :raises InvalidRequest: 400 in Anthropic's terms, for anything Anthropic would refuse and
        for what Kiln's models cannot take (documents, forced server tools).
    """
    if not isinstance(body, dict):
        raise _invalid("body", "Input should be an object", "invalid_type")
    _refuse_extra(body, fields, "")
    body = {k: v for k, v in body.items() if v is not None}
    out = Translation()
    chat = out.chat
    model = body.get("model")
    if model is None:
        raise _invalid("model", "Field required", "missing_required_parameter")
    chat["model"] = model
    entry = catalog.get(model) if isinstance(model, str) else None
    if "max_tokens" in fields:
        _max_tokens(body, entry, out)
    _sampling(body, entry, chat)
    _drop_checked(body)
    system = _system(body.get("system"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "Input should be a non-empty list",
                       "missing_required_parameter" if messages is None else "invalid_type")
    if system is not None:
        out.origins.append(("system", [f"system.{i}" for i in range(len(system[1]))], []))
        chat["messages"] = [system[0]]
    else:
        chat["messages"] = []
    for i, message in enumerate(messages):
        _message(message, f"messages.{i}", out)
    offered = _tools(body.get("tools"), out)
    _tool_choice(body.get("tool_choice"), offered, out)
    _thinking(body, entry, out)
    _output_format(body.get("output_config"), chat)
    metadata = body.get("metadata")
    if metadata is not None:
        _refuse_extra(_object(metadata, "metadata"), {"user_id"}, "metadata")
        if metadata.get("user_id") is not None:
            chat["user"] = _string(metadata["user_id"], "metadata.user_id")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "Input should be a valid boolean", "invalid_type")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return out


def _max_tokens(body, entry, out):
    """``max_tokens`` is required; above the model's maximum output it is lowered to it (and
    said in :data:`MAX_TOKENS_LOWERED_HEADER`): agent clients ask for more than a self-hosted
    model's maximum whatever the model (docs/MESSAGES.md)."""
    if "max_tokens" not in body:
        raise _invalid("max_tokens", "Field required", "missing_required_parameter")
    value = body["max_tokens"]
    if value == 0 and not isinstance(value, bool):
        raise UnsupportedParameter("max_tokens: 0 (warming Anthropic's prompt cache without a "
                                   "reply) is not supported: prefix caching is the model "
                                   "server's own.", param="max_tokens")
    asked = _int(value, "max_tokens", 1)
    held = asked if entry is None else min(asked, entry.max_output_tokens)
    if held != asked:
        out.headers[MAX_TOKENS_LOWERED_HEADER] = f"{asked}->{held}"
    out.chat["max_tokens"] = held


def _sampling(body, entry, chat):
    if "temperature" in body:  # Anthropic's range is 0..1 (OpenAI's 0..2)
        chat["temperature"] = _number(body["temperature"], "temperature", 0, 1)
    if "top_p" in body:
        chat["top_p"] = _number(body["top_p"], "top_p", 0, 1)
    if "top_k" in body:
        top_k = _int(body["top_k"], "top_k", 0)
        if entry is not None and "top_k" in entry.extra_params:
            chat["top_k"] = top_k  # the catalog forwards it to every backend of the model
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _invalid("stop_sequences", "Input should be a list of non-empty strings",
                           "invalid_type")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _invalid("stop_sequences", f"Kiln takes at most {MAX_STOP_SEQUENCES} stop "
                           f"sequences (it enforces each on the output); {len(stops)} were sent")
        if stops:
            chat["stop"] = list(stops)


def _drop_checked(body):
    """Check the fields that are accepted and dropped (their shape, as Anthropic would)."""
    if "service_tier" in body:
        _one_of(body["service_tier"], SERVICE_TIERS, "service_tier")
    if "speed" in body:
        _one_of(body["speed"], SPEEDS, "speed")
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        if name in body:
            _string(body[name], name)
    _cache_control(body.get("cache_control"), "cache_control")
    if "diagnostics" in body:
        _refuse_extra(_object(body["diagnostics"], "diagnostics"), {"previous_message_id"},
                      "diagnostics")
    container = body.get("container")
    if container is not None and not isinstance(container, str):
        _refuse_extra(_object(container, "container"), {"id", "skills"}, "container")


def _system(system):
    """Return ``(chat system message, text blocks)`` or None."""
    if system is None:
        return None
    if isinstance(system, str):
        return {"role": "system", "content": system}, []
    if not isinstance(system, list):
        raise _invalid("system", "Input should be a string or a list of text blocks",
                       "invalid_type")
    parts = [_text_part(block, f"system.{i}") for i, block in enumerate(system)]
    if not parts:
        return None
    return {"role": "system", "content": parts}, parts


def _text_part(block, where):
    _object(block, where)
    if block.get("type") != "text":
        raise _invalid(f"{where}.type", "Input should be 'text'")
    _refuse_extra(block, BLOCK_KEYS["text"], where)
    _cache_control(block.get("cache_control"), f"{where}.cache_control")
    return {"type": "text", "text": _string(block.get("text"), f"{where}.text")}


def _message(message, where, out):
    _object(message, where)
    _refuse_extra(message, MESSAGE_KEYS, where)
    role = message.get("role")
    if role not in ROLE_BLOCKS:
        raise _invalid(f"{where}.role", "Input should be 'user', 'assistant' or 'system'")
    content = message.get("content")
    if isinstance(content, str):
        out.origins.append((where, [], []))
        out.chat["messages"].append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise _invalid(f"{where}.content", "Input should be a string or a list of blocks",
                       "invalid_type")
    blocks = []
    for j, block in enumerate(content):
        path = f"{where}.content.{j}"
        _object(block, path)
        kind = block.get("type")
        if kind in UNSUPPORTED_BLOCKS:
            raise UnsupportedParameter(f"{path}: {UNSUPPORTED_BLOCKS[kind]}.", param=path)
        if kind not in ROLE_BLOCKS[role]:
            allowed = ", ".join(sorted(ROLE_BLOCKS[role]))
            raise _invalid(f"{path}.type", f"{role} messages take blocks of type {allowed}")
        _refuse_extra(block, BLOCK_KEYS[kind], path)
        _cache_control(block.get("cache_control"), f"{path}.cache_control")
        blocks.append((path, block))
    {"user": _user, "assistant": _assistant, "system": _system_message}[role](
        blocks, where, out)


def _system_message(blocks, where, out):
    parts = [_text_part(block, path) for path, block in blocks]
    out.origins.append((where, [path for path, _ in blocks], []))
    out.chat["messages"].append({"role": "system", "content": parts or ""})


def _user(blocks, where, out):
    """Tool results become ``tool`` messages (OpenAI's shape: they follow the assistant's tool
    calls), then the other blocks one user message; images inside tool results join it, as
    OpenAI's tool messages carry text only."""
    parts, paths = [], []
    for path, block in blocks:
        if block["type"] == "tool_result":
            images = _tool_result(block, path, out)
            parts.extend(part for part, _ in images)
            paths.extend(p for _, p in images)
        else:
            parts.append(_user_part(block, path))
            paths.append(path)
    if parts or not blocks:
        out.origins.append((where, paths, []))
        out.chat["messages"].append({"role": "user", "content": parts})


def _user_part(block, path):
    if block["type"] == "text":
        return _text_part(block, path)
    return {"type": "image_url", "image_url": {"url": _image_url(block.get("source"),
                                                                 f"{path}.source")}}


def _image_url(source, where):
    """An image source as the URL the chat contract checks (``data:`` or ``https://``)."""
    _object(source, where)
    kind = source.get("type")
    if kind == "base64":
        _refuse_extra(source, {"type", "media_type", "data"}, where)
        media = _one_of(source.get("media_type"), IMAGE_MEDIA_TYPES, f"{where}.media_type")
        return f"data:{media};base64,{_string(source.get('data'), f'{where}.data')}"
    if kind == "url":
        _refuse_extra(source, {"type", "url"}, where)
        return _string(source.get("url"), f"{where}.url", empty=False)
    if kind == "file":
        raise UnsupportedParameter(f"{where}: file sources need Anthropic's Files API, which "
                                   f"Kiln does not have; send the image as base64 or a URL.",
                                   param=where)
    raise _invalid(f"{where}.type", "Input should be 'base64' or 'url'")


def _tool_result(block, path, out):
    """Append the ``tool`` message of one tool result; return its image parts with their
    paths."""
    call_id = _string(block.get("tool_use_id"), f"{path}.tool_use_id", empty=False)
    content = block.get("content", "")
    texts, images = [], []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, item in enumerate(content):
            where = f"{path}.content.{k}"
            _object(item, where)
            kind = item.get("type")
            if kind in UNSUPPORTED_BLOCKS:
                raise UnsupportedParameter(f"{where}: {UNSUPPORTED_BLOCKS[kind]}.", param=where)
            if kind not in TOOL_RESULT_BLOCKS:
                raise _invalid(f"{where}.type", "Input should be 'text' or 'image'")
            _refuse_extra(item, BLOCK_KEYS[kind], where)
            _cache_control(item.get("cache_control"), f"{where}.cache_control")
            if kind == "text":
                texts.append(_text_part(item, where)["text"])
            else:
                images.append((_user_part(item, where), where))
    else:
        raise _invalid(f"{path}.content", "Input should be a string or a list of blocks",
                       "invalid_type")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _invalid(f"{path}.is_error", "Input should be a valid boolean", "invalid_type")
    text = "\n".join(texts)
    if is_error:
        text = TOOL_ERROR_PREFIX + text
    out.origins.append((path, [], []))
    out.chat["messages"].append({"role": "tool", "tool_call_id": call_id, "content": text})
    return images


def _assistant(blocks, where, out):
    """Text blocks are the content, tool_use blocks the tool calls (input as JSON text);
    thinking blocks sent back are dropped: only the model that wrote them can read them."""
    parts, paths, calls, call_paths = [], [], [], []
    for path, block in blocks:
        kind = block["type"]
        if kind == "text":
            parts.append(_text_part(block, path))
            paths.append(path)
        elif kind == "tool_use":
            _object(block.get("input"), f"{path}.input")
            calls.append({"id": _string(block.get("id"), f"{path}.id", empty=False),
                          "type": "function",
                          "function": {"name": _string(block.get("name"), f"{path}.name",
                                                       empty=False),
                                       "arguments": json.dumps(block["input"],
                                                               ensure_ascii=False)}})
            call_paths.append(path)
        elif kind == "thinking":
            _string(block.get("thinking"), f"{path}.thinking")
            _string(block.get("signature"), f"{path}.signature")
        else:
            _string(block.get("data"), f"{path}.data")
    message = {"role": "assistant", "content": parts or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    out.origins.append((where, paths, call_paths))
    out.chat["messages"].append(message)


def _tools(tools, out):
    """Custom tools become function tools; Anthropic's server and built-in tools (any typed
    tool but ``custom``) are left out of what the backend sees. Return ``(custom names,
    server names)``."""
    if tools is None:
        return set(), set()
    if not isinstance(tools, list):
        raise _invalid("tools", "Input should be a list", "invalid_type")
    functions, custom, server = [], set(), set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        _object(tool, where)
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            _string(kind, f"{where}.type")
            server.add(tool.get("name") if isinstance(tool.get("name"), str) else kind)
            continue
        _refuse_extra(tool, CUSTOM_TOOL_KEYS, where)
        _cache_control(tool.get("cache_control"), f"{where}.cache_control")
        name = _string(tool.get("name"), f"{where}.name", empty=False)
        schema = _object(tool.get("input_schema"), f"{where}.input_schema")
        description = tool.get("description")
        if description is not None:
            _string(description, f"{where}.description")
        # Optional in Anthropic's reference; the chat contract needs one (model servers'
        # templates render it): the tool's name stands in.
        function = {"name": name, "description": description or name, "parameters": schema}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        functions.append({"type": "function", "function": function})
        out.tool_paths.append(where)
        custom.add(name)
    if functions:
        out.chat["tools"] = functions
    return custom, server


def _tool_choice(choice, offered, out):
    custom, server = offered
    if choice is None:
        return
    _object(choice, "tool_choice")
    kind = _one_of(choice.get("type"), ("auto", "any", "tool", "none"), "tool_choice.type")
    keys = {"type"} | ({"disable_parallel_tool_use"} if kind != "none" else set()) | (
        {"name"} if kind == "tool" else set())
    _refuse_extra(choice, keys, "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _invalid("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean",
                       "invalid_type")
    chat = out.chat
    if kind == "tool":
        name = _string(choice.get("name"), "tool_choice.name", empty=False)
        if name in server and name not in custom:
            raise UnsupportedParameter(f"tool_choice: '{name}' is one of Anthropic's server "
                                       f"tools, which Kiln's models do not run; it cannot be "
                                       f"forced.", param="tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind == "any":
        if not custom:
            raise UnsupportedParameter("tool_choice: 'any' forces a tool, and no custom tool "
                                       "was offered (Anthropic's server tools are not run by "
                                       "Kiln's models).", param="tool_choice")
        chat["tool_choice"] = "required"
    elif custom:  # with no tool left, auto and none say nothing to the backend
        chat["tool_choice"] = kind
    if disable and custom:
        chat["parallel_tool_calls"] = False


def _thinking(body, entry, out):
    """``thinking`` and ``output_config.effort``: checked as Anthropic does; sent as
    ``reasoning_effort`` only to models whose template reads it, else dropped. Thinking counts
    within ``max_tokens`` (as on Anthropic), so the hold covers it."""
    effort = None
    thinking = body.get("thinking")
    if thinking is not None:
        _object(thinking, "thinking")
        kind = _one_of(thinking.get("type"), THINKING_TYPES, "thinking.type")
        _refuse_extra(thinking, THINKING_KEYS[kind], "thinking")
        if thinking.get("display") is not None:
            _one_of(thinking["display"], THINKING_DISPLAYS, "thinking.display")
        if kind == "enabled":
            budget = _int(thinking.get("budget_tokens"), "thinking.budget_tokens",
                          MIN_THINKING_BUDGET)
            asked = body.get("max_tokens")
            if isinstance(asked, int) and budget >= asked:
                raise _invalid("thinking.budget_tokens", "must be less than max_tokens "
                               f"({budget} >= {asked})")
            effort = next(e for bound, e in EFFORT_BY_BUDGET if bound is None or budget < bound)
    config = body.get("output_config")
    if config is not None:
        _refuse_extra(_object(config, "output_config"), {"effort", "format"}, "output_config")
        if config.get("effort") is not None:
            effort = _one_of(config["effort"], EFFORTS, "output_config.effort")
            out.top["reasoning_effort"] = "output_config.effort"
    if effort and entry is not None and entry.family in REASONING_EFFORT_FAMILIES:
        out.chat["reasoning_effort"] = effort


def _output_format(config, chat):
    fmt = (config or {}).get("format")
    if fmt is None:
        return
    _refuse_extra(_object(fmt, "output_config.format"), {"type", "schema"},
                  "output_config.format")
    _one_of(fmt.get("type"), ("json_schema",), "output_config.format.type")
    schema = _object(fmt.get("schema"), "output_config.format.schema")
    chat["response_format"] = {"type": "json_schema",
                               "json_schema": {"name": "output", "schema": schema}}


def parse_messages(body, catalog, body_bytes):
    """Return the :class:`gateway.contract.validation.ChatRequest` of a Messages ``body``.

    :raises GatewayError: 400 (404 for an unknown model) naming the field in Anthropic's terms.
    """
    out = translate(body, catalog)
    try:
        chat = validate_chat(out.chat, catalog, body_bytes)
    except GatewayError as err:
        raise out.rename(err) from None
    chat.response_headers.update(out.headers)
    return chat


def count_input_tokens(body, catalog, body_bytes, count):
    """Return the input tokens of a ``count_tokens`` body: Kiln's prompt estimate of the
    request as a backend would be sent it (:func:`gateway.flow.metering.estimate_prompt`,
    which errs upward), with ``count(text) -> int | None`` the backend's tokenizer."""
    out = translate(body, catalog, COUNT_FIELDS)
    try:
        chat = validate_chat(out.chat, catalog, body_bytes)
    except GatewayError as err:
        raise out.rename(err) from None
    return estimate_prompt({"messages": chat.messages, "tools": chat.params.get("tools")},
                           chat.n_messages, chat.entry.context_window, chat.has_images, count)
