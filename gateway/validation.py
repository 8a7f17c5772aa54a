"""The request contract of ``POST /v1/chat/completions``, checked before admission.

Rules follow the endpoint reference's "Request body" section; where the reference documents a
weakness (silent 500s, ignored ``stop``, empty ``response_format`` replies), Kiln rejects or
enforces instead. A rejected request calls no upstream, writes nothing and charges nothing.
"""
import json
from dataclasses import dataclass

from . import parameters
from .errors import InvalidRequest, ModelNotFound, PayloadTooLarge, UnsupportedParameter

ROLES = ("system", "user", "assistant", "tool")
# No tokenizer puts more than this many bytes of JSON text in one token: a text-only body
# above context_window x this cannot fit the window.
MAX_BYTES_PER_TOKEN = 64
# Content part type -> the field that carries it (OpenAI chat content parts).
PART_TYPES = {"text": "text", "image_url": "image_url", "input_audio": "input_audio",
              "file": "file"}


@dataclass
class ChatRequest:
    """A validated chat request: what to forward, and what Kiln itself enforces."""

    entry: object            # gateway.catalog.ModelEntry
    body: dict               # forwarded to the backend (``model`` set per backend at send time)
    stream: bool
    include_usage: bool      # the client asked for the usage chunk
    stop: tuple              # stop strings Kiln enforces on the output
    single_tool_call: bool   # parallel_tool_calls false on a model that cannot honour it
    body_bytes: int
    n_messages: int
    has_images: bool
    max_tokens: int = None
    n: int = 1
    backend: object = None   # gateway.catalog.Backend, picked before admission (503 if none)


def parse_json_body(raw, content_type, max_body_bytes):
    """Parse the raw request body into a dict.

    :raises PayloadTooLarge: over ``max_body_bytes`` (413).
    :raises InvalidRequest: not ``application/json``, empty, not JSON or not an object (400).
    """
    if len(raw) > max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {max_body_bytes} bytes.")
    mimetype = (content_type or "").split(";")[0].strip().lower()
    if mimetype != "application/json":
        raise InvalidRequest("Content-Type must be application/json.", code="invalid_content_type")
    if not raw.strip():
        raise InvalidRequest("Request body is empty: send a JSON object.", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"Request body is not valid JSON: {err}", code="invalid_json") from err
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    return body


def _reject_constant(name):
    # Python's json reads NaN and Infinity, which are not JSON (RFC 8259) and which the
    # backend could not read back once forwarded.
    raise ValueError(f"{name} is not a JSON number")


def validate_chat(body, catalog, body_bytes):
    """Check ``body`` against the contract and return a :class:`ChatRequest`.

    :param catalog: ``{model id: ModelEntry}``.
    :raises InvalidRequest: 400, ``param`` naming the field at fault.
    :raises ModelNotFound: 404 ``model_not_found``.
    """
    entry = _model(body, catalog)
    messages = body.get("messages")
    has_images = _messages(messages, entry)
    if not has_images and body_bytes > entry.context_window * MAX_BYTES_PER_TOKEN:
        # Certain to overflow the context window: refused here rather than after the model
        # server has spent its time tokenizing it (a single-slot server stalls for everyone).
        raise InvalidRequest(f"The request ({body_bytes} bytes) cannot fit model "
                             f"'{entry.id}''s context window of {entry.context_window} tokens.",
                             param="messages", code="context_length_exceeded")
    stream = _stream(body.get("stream"))
    forward = dict(body)
    forward["stream"] = stream
    include_usage = _stream_options(body, stream, forward)
    parameters.check_tools(body.get("tools"))
    parameters.check_tool_choice(body.get("tool_choice"), entry)
    single_tool_call = parameters.parallel_tool_calls(body, entry, forward)
    parameters.check_enums_and_ranges(body)
    parameters.check_response_format(body.get("response_format"), entry)
    if body.get("ignore_eos") is True and entry.family == "gpt-oss":
        raise UnsupportedParameter("ignore_eos is not supported on gpt-oss models: remove it.",
                                   param="ignore_eos")
    max_tokens = parameters.max_tokens(body, entry)
    if max_tokens is None:
        # The hold assumed the model's max output: make the backend keep to it, so that the
        # cost is never capped by the hold (a server's own default may be its whole window).
        forward["max_tokens"] = entry.max_output_tokens
    return ChatRequest(entry=entry, body=forward, stream=stream, include_usage=include_usage,
                       stop=parameters.stop_strings(body.get("stop")),
                       single_tool_call=single_tool_call, body_bytes=body_bytes,
                       n_messages=len(messages), has_images=has_images, max_tokens=max_tokens,
                       n=parameters.n_choices(body))


def _model(body, catalog):
    model = body.get("model")
    if model is None:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model",
                             code="missing_required_parameter")
    if not isinstance(model, str):
        raise InvalidRequest("Invalid 'model': expected a string.", param="model",
                             code="invalid_type")
    entry = catalog.get(model)
    if entry is None:
        raise ModelNotFound(f"The model '{model[:200]}' does not exist. See GET /v1/models.",
                            param="model")
    return entry


def _messages(messages, entry):
    if messages is None or messages == []:
        # Exactly as the endpoint reference's 400 example.
        raise InvalidRequest("Invalid 'messages': the array must contain at least one message.",
                             param="messages", code="empty_array")
    if not isinstance(messages, list):
        raise InvalidRequest("Invalid 'messages': expected an array of messages.",
                             param="messages", code="invalid_type")
    has_images = False
    for i, message in enumerate(messages):
        has_images |= _message(i, message, entry)
    return has_images


def _message(i, message, entry):
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"Invalid '{where}': expected an object.", param=where,
                             code="invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"Invalid '{where}.role': {role!r} is not one of "
                             f"{', '.join(ROLES)}.", param=f"{where}.role", code="invalid_value")
    content = message.get("content")
    if role == "system":
        _require_string(content, f"{where}.content")
        return False
    if role == "assistant":
        return _assistant(message, content, where, entry)
    if role == "tool":
        _require_string(message.get("tool_call_id"), f"{where}.tool_call_id")
    return _text_or_parts(content, f"{where}.content", entry)


def _require_string(value, param):
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{param}'.", param=param,
                             code="missing_required_parameter")
    if not isinstance(value, str):
        raise InvalidRequest(f"Invalid '{param}': expected a string.", param=param,
                             code="invalid_type")


def _text_or_parts(content, param, entry):
    """Check a string or an array of content parts (forwarded unchanged); return whether it
    holds an image part."""
    if not isinstance(content, list):
        _require_string(content, param)
        return False
    has_images = False
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"Invalid '{where}': expected a content part object with a "
                                 f"'type'.", param=where, code="invalid_type")
        _part_fields(part, where)
        if part["type"] == "image_url":
            if "image" not in entry.input:
                # The reference warns images fail silently on text-only models; refuse instead.
                raise UnsupportedParameter(
                    f"Invalid '{where}': model '{entry.id}' does not accept image input.",
                    param=where)
            has_images = True
    return has_images


def _part_fields(part, where):
    """Check a content part's own fields (OpenAI's part types); the backend would answer a
    malformed one with a 500, seen by the client as a bare 502."""
    kind = part["type"]
    if kind not in PART_TYPES:
        raise InvalidRequest(f"Invalid '{where}.type': {kind[:40]!r} is not one of "
                             f"{', '.join(PART_TYPES)}.", param=f"{where}.type",
                             code="invalid_value")
    value = part.get(PART_TYPES[kind])
    if kind == "text":
        _require_string(value, f"{where}.text")
    elif kind == "image_url" and not (isinstance(value, str) or (
            isinstance(value, dict) and isinstance(value.get("url"), str))):
        raise InvalidRequest(f"Invalid '{where}.image_url': expected an object with a 'url'.",
                             param=f"{where}.image_url", code="invalid_type")
    elif not isinstance(value, (dict, str)):
        raise InvalidRequest(f"Invalid '{where}.{PART_TYPES[kind]}': expected an object.",
                             param=f"{where}.{PART_TYPES[kind]}", code="invalid_type")


def _assistant(message, content, where, entry):
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise InvalidRequest(f"Invalid '{where}.tool_calls': expected an array.",
                             param=f"{where}.tool_calls", code="invalid_type")
    if content is None and tool_calls:
        return False  # a tool-call reply: content may be null or absent (reference)
    return _text_or_parts(content, f"{where}.content", entry)


def _stream(value):
    """Read ``stream`` as the reference does: ``true``, ``"true"``, ``1`` are true; ``false``,
    ``"false"``, ``0``, ``null`` are false; nothing else (not ``"1"``, ``1.0``, ``"True"``)."""
    integer = parameters.is_int(value)
    if value is True or value == "true" or (integer and value == 1):
        return True
    if value is False or value is None or value == "false" or (integer and value == 0):
        return False
    code = "invalid_value" if isinstance(value, str) or integer else "invalid_type"
    raise InvalidRequest("Invalid 'stream': expected true or false (also \"true\", \"false\", "
                         "1 or 0).", param="stream", code=code)


def _stream_options(body, stream, forward):
    options = body.get("stream_options")
    if options is None:
        if stream:
            forward["stream_options"] = {"include_usage": True}
        return False
    if not stream:
        raise InvalidRequest("Invalid 'stream_options': only allowed when 'stream' is true.",
                             param="stream_options", code="invalid_value")
    if not isinstance(options, dict):
        raise InvalidRequest("Invalid 'stream_options': expected an object.",
                             param="stream_options", code="invalid_type")
    wanted = options.get("include_usage", False)
    if not isinstance(wanted, bool):
        raise InvalidRequest("Invalid 'stream_options.include_usage': expected a boolean.",
                             param="stream_options.include_usage", code="invalid_type")
    # Kiln meters every stream, so the backend always sends usage; other keys are kept.
    forward["stream_options"] = {**options, "include_usage": True}
    return wanted
