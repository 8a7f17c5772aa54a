"""Blocks and messages of an Anthropic Messages request as OpenAI chat messages, and the checks
of single values the request side shares (:mod:`.messages_request`).

Blocks follow Anthropic's Messages API reference (https://docs.claude.com/en/api/messages) as
the official ``anthropic`` SDK types them (``ContentBlockParam``); docs/MESSAGES.md, "Messages
and blocks", is the table. Each chat message made is recorded with the Anthropic path it came
from, so that an error of the chat contract names the block at fault.
"""
import json

from ..errors import InvalidRequest, UnsupportedParameter

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
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
CACHE_CONTROL_KEYS = {"type", "ttl"}
CACHE_TTLS = ("5m", "1h")
TOOL_ERROR_PREFIX = "[tool error] "


def extra_input(param):
    """Anthropic's refusal of a field outside its reference."""
    return InvalidRequest(f"{param}: Extra inputs are not permitted", param=param,
                          code="unknown_parameter")


def invalid(param, message, code="invalid_value"):
    return InvalidRequest(f"{param}: {message}", param=param, code=code)


def refuse_extra(obj, allowed, where):
    for key in obj:
        if key not in allowed:
            raise extra_input(f"{where}.{str(key)[:100]}" if where else str(key)[:100])


def as_object(value, param):
    if not isinstance(value, dict):
        raise invalid(param, "Input should be an object", "invalid_type")
    return value


def as_string(value, param, *, empty=True):
    if not isinstance(value, str) or (not empty and not value):
        raise invalid(param, "Input should be a non-empty string" if not empty
                       else "Input should be a valid string", "invalid_type")
    return value


def as_int(value, param, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(param, f"Input should be an integer of at least {low}")
    return value


def as_number(value, param, low, high):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise invalid(param, f"Input should be a number from {low} to {high}")
    return value


def one_of(value, values, param):
    if value not in values:
        raise invalid(param, f"Input should be one of {', '.join(values)}")
    return value


def check_cache_control(value, param):
    if value is None:
        return
    refuse_extra(as_object(value, param), CACHE_CONTROL_KEYS, param)
    one_of(value.get("type"), ("ephemeral",), f"{param}.type")
    if value.get("ttl") is not None:
        one_of(value["ttl"], CACHE_TTLS, f"{param}.ttl")


def system_prompt(system):
    """Return ``(chat system message, text blocks)`` or None."""
    if system is None:
        return None
    if isinstance(system, str):
        return {"role": "system", "content": system}, []
    if not isinstance(system, list):
        raise invalid("system", "Input should be a string or a list of text blocks",
                       "invalid_type")
    parts = [text_part(block, f"system.{i}") for i, block in enumerate(system)]
    if not parts:
        return None
    return {"role": "system", "content": parts}, parts


def text_part(block, where):
    as_object(block, where)
    if block.get("type") != "text":
        raise invalid(f"{where}.type", "Input should be 'text'")
    refuse_extra(block, BLOCK_KEYS["text"], where)
    check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    return {"type": "text", "text": as_string(block.get("text"), f"{where}.text")}


def translate_message(message, where, out):
    as_object(message, where)
    refuse_extra(message, MESSAGE_KEYS, where)
    role = message.get("role")
    if role not in ROLE_BLOCKS:
        raise invalid(f"{where}.role", "Input should be 'user', 'assistant' or 'system'")
    content = message.get("content")
    if isinstance(content, str):
        out.origins.append((where, [], []))
        out.chat["messages"].append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "Input should be a string or a list of blocks",
                       "invalid_type")
    blocks = []
    for j, block in enumerate(content):
        path = f"{where}.content.{j}"
        as_object(block, path)
        kind = block.get("type")
        if kind in UNSUPPORTED_BLOCKS:
            raise UnsupportedParameter(f"{path}: {UNSUPPORTED_BLOCKS[kind]}.", param=path)
        if kind not in ROLE_BLOCKS[role]:
            allowed = ", ".join(sorted(ROLE_BLOCKS[role]))
            raise invalid(f"{path}.type", f"{role} messages take blocks of type {allowed}")
        refuse_extra(block, BLOCK_KEYS[kind], path)
        check_cache_control(block.get("cache_control"), f"{path}.cache_control")
        blocks.append((path, block))
    {"user": _user, "assistant": _assistant, "system": _system_message}[role](
        blocks, where, out)


def _system_message(blocks, where, out):
    parts = [text_part(block, path) for path, block in blocks]
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
        return text_part(block, path)
    return {"type": "image_url", "image_url": {"url": _image_url(block.get("source"),
                                                                 f"{path}.source")}}


def _image_url(source, where):
    """An image source as the URL the chat contract checks (``data:`` or ``https://``)."""
    as_object(source, where)
    kind = source.get("type")
    if kind == "base64":
        refuse_extra(source, {"type", "media_type", "data"}, where)
        media = one_of(source.get("media_type"), IMAGE_MEDIA_TYPES, f"{where}.media_type")
        return f"data:{media};base64,{as_string(source.get('data'), f'{where}.data')}"
    if kind == "url":
        refuse_extra(source, {"type", "url"}, where)
        return as_string(source.get("url"), f"{where}.url", empty=False)
    if kind == "file":
        raise UnsupportedParameter(f"{where}: file sources need Anthropic's Files API, which "
                                   f"Kiln does not have; send the image as base64 or a URL.",
                                   param=where)
    raise invalid(f"{where}.type", "Input should be 'base64' or 'url'")


def _tool_result(block, path, out):
    """Append the ``tool`` message of one tool result; return its image parts with their
    paths."""
    call_id = as_string(block.get("tool_use_id"), f"{path}.tool_use_id", empty=False)
    content = block.get("content", "")
    texts, images = [], []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, item in enumerate(content):
            where = f"{path}.content.{k}"
            as_object(item, where)
            kind = item.get("type")
            if kind in UNSUPPORTED_BLOCKS:
                raise UnsupportedParameter(f"{where}: {UNSUPPORTED_BLOCKS[kind]}.", param=where)
            if kind not in TOOL_RESULT_BLOCKS:
                raise invalid(f"{where}.type", "Input should be 'text' or 'image'")
            refuse_extra(item, BLOCK_KEYS[kind], where)
            check_cache_control(item.get("cache_control"), f"{where}.cache_control")
            if kind == "text":
                texts.append(text_part(item, where)["text"])
            else:
                images.append((_user_part(item, where), where))
    else:
        raise invalid(f"{path}.content", "Input should be a string or a list of blocks",
                       "invalid_type")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{path}.is_error", "Input should be a valid boolean", "invalid_type")
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
            parts.append(text_part(block, path))
            paths.append(path)
        elif kind == "tool_use":
            as_object(block.get("input"), f"{path}.input")
            calls.append({"id": as_string(block.get("id"), f"{path}.id", empty=False),
                          "type": "function",
                          "function": {"name": as_string(block.get("name"), f"{path}.name",
                                                       empty=False),
                                       "arguments": json.dumps(block["input"],
                                                               ensure_ascii=False)}})
            call_paths.append(path)
        elif kind == "thinking":
            as_string(block.get("thinking"), f"{path}.thinking")
            as_string(block.get("signature"), f"{path}.signature")
        else:
            as_string(block.get("data"), f"{path}.data")
    message = {"role": "assistant", "content": parts or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    out.origins.append((where, paths, call_paths))
    out.chat["messages"].append(message)
