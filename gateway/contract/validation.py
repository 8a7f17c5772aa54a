"""The request contract of ``POST /v1/chat/completions``: the body and its messages, checked
before admission.

Rules follow README "API" and docs/PARAMETERS.md, "Messages": the message shapes of the current
OpenAI chat API (roles ``developer``, ``system``, ``user``, ``assistant``, ``tool`` and the
deprecated ``function``; content as a string or as parts). Where a model server fails silently
(images on text-only models), Kiln refuses instead. A rejected request calls
no backend, writes nothing and charges nothing. The other parameters are checked in
:mod:`gateway.contract.parameters`, which also builds the body each backend is sent; the JSON itself
(numbers, nesting, text) in :mod:`gateway.contract.json_body`.
"""
import json
import re
from dataclasses import dataclass, field

import gevent

from . import images, parameters, replies, tools
from .catalog import CHAT, COMPLETIONS, EMBEDDINGS
from ..errors import InvalidRequest, ModelNotFound, UnsupportedParameter, refuse_unknown_keys
from ..billing import prompt_bound

# No tokenizer puts more than this many bytes of JSON text in one token: a text-only body
# above context_window x this cannot fit the window.
MAX_BYTES_PER_TOKEN = 64
# A body of many messages is checked in slices this long, letting the worker's other requests
# run in between (gateway/api/intake.py: bounded work before admission).
YIELD_EVERY = 1024
# Content part types each role may send (OpenAI chat API), and the member carrying each part.
PART_FIELDS = {"text": "text", "image_url": "image_url", "input_audio": "input_audio",
               "file": "file", "refusal": "refusal"}
# The keys each role's message may carry (the openai SDK's ``ChatCompletion*MessageParam``
# types). Any other key is refused as OpenAI refuses an unknown parameter: nothing unchecked
# reaches a backend (docs/PARAMETERS.md, "Messages").
MESSAGE_KEYS = {
    "developer": {"role", "content", "name"}, "system": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "audio", "tool_calls", "function_call"},
    "tool": {"role", "content", "tool_call_id"}, "function": {"role", "content", "name"},
}
# The keys of each content part type (``prompt_cache_breakpoint`` is OpenAI's cache hint:
# accepted, never sent), and of the object a part carries, with its enumerated values.
CACHE_BREAKPOINT = "prompt_cache_breakpoint"
PART_KEYS = {"text": {"type", "text", CACHE_BREAKPOINT},
             "image_url": {"type", "image_url", CACHE_BREAKPOINT},
             "input_audio": {"type", "input_audio", CACHE_BREAKPOINT},
             "file": {"type", "file", CACHE_BREAKPOINT}, "refusal": {"type", "refusal"}}
PART_VALUE_KEYS = {"image_url": {"url", "detail"}, "input_audio": {"data", "format"},
                   "file": {"file_data", "file_id", "filename"},
                   CACHE_BREAKPOINT: {"mode", "ttl"}}
PART_VALUES = {"image_url.detail": ("auto", "low", "high", "original"),
               "input_audio.format": ("wav", "mp3"),
               f"{CACHE_BREAKPOINT}.mode": ("explicit",),
               f"{CACHE_BREAKPOINT}.ttl": ("30m", "12h")}
ROLE_PARTS = {"developer": {"text"}, "system": {"text"}, "tool": {"text"},
              "user": {"text", "image_url", "input_audio", "file"},
              "assistant": {"text", "refusal"}}
ROLES = ("developer", "system", "user", "assistant", "tool", "function")
# Modalities a part needs in the model's catalog ``input`` list.
PART_MODALITY = {"image_url": "image", "input_audio": "audio", "file": "file"}


# The kinds of answer the flow reads (:attr:`ChatRequest.kind`): a chat completion, a text
# completion (OpenAI's legacy ``text_completion``), a list of embeddings.
CHAT_ANSWER, TEXT_ANSWER, EMBEDDINGS_ANSWER = "chat", "text", "embeddings"
# The path under a backend's base URL each endpoint is sent to.
BACKEND_PATHS = {CHAT: "/chat/completions", COMPLETIONS: "/completions",
                 EMBEDDINGS: "/embeddings"}
# What OpenAI answers a request to an endpoint its model does not serve (its wording where it
# has one), by the endpoint asked for; ``{hint}`` names an endpoint the model does serve.
NOT_SERVED = {
    CHAT: "This is not a chat model and thus not supported in the v1/chat/completions "
          "endpoint. Did you mean to use {hint}?",
    COMPLETIONS: "This is a chat model and not supported in the v1/completions endpoint. "
                 "Did you mean to use {hint}?",
    EMBEDDINGS: "This model does not support the v1/embeddings endpoint. Did you mean to use "
                "{hint}?",
}
HINTS = {CHAT: "v1/chat/completions", COMPLETIONS: "v1/completions", EMBEDDINGS: "v1/embeddings"}


@dataclass
class ChatRequest:
    """A validated chat request: what the client asked, and what Kiln enforces itself.

    The body a backend gets is built from it by :func:`gateway.contract.parameters.upstream_body`.
    The flow reads every canonical request through the same members (:attr:`kind`,
    :attr:`path`, :meth:`body_for`, :attr:`routing_messages`, :attr:`prompt_bound`,
    :attr:`completion_cap`); :mod:`gateway.contract.legacy` has the completions and
    embeddings requests.
    """

    kind = CHAT_ANSWER
    path = BACKEND_PATHS[CHAT]

    entry: object            # gateway.contract.catalog.ModelEntry
    messages: list           # validated messages, as the client sent them
    params: dict             # other accepted parameters, validated (None values dropped)
    stream: bool
    include_usage: bool      # the client asked for the usage chunk
    stop: tuple              # stop strings Kiln enforces on the output
    single_tool_call: bool   # parallel_tool_calls false on a model that cannot honour it
    max_tokens: int          # the completion cap of one choice, written by Kiln
    n: int                   # choices asked for
    body_bytes: int
    has_images: bool
    conversation_key: str = ""   # system prompt + first user turn (prefix-affinity routing)
    # Image URLs whose hosts are names, resolved and checked before admission (api/generate.py).
    image_lookups: tuple = ()
    extras: dict = field(default_factory=dict)  # catalog-allowed non-OpenAI parameters
    response_headers: dict = field(default_factory=dict)  # what the codec tells in the answer

    @property
    def completion_cap(self):
        """Completion tokens held for and let through, every choice together."""
        return self.max_tokens * self.n

    @property
    def routing_messages(self):
        """The messages prefix-affinity routing keys on."""
        return self.messages

    @property
    def reply_bound(self):
        """The most bytes a whole reply to this request can take (docs/RELIABILITY.md, "Big
        answers"); None when catalog-allowed extra parameters may ask for more than Kiln can
        size (``KILN_MAX_REPLY_BYTES`` alone bounds it then)."""
        if self.extras:
            return None
        entries = (1 + parameters.logprob_alternatives(self.params)
                   if self.params.get("logprobs") is True else 0)
        return replies.reply_bytes(self.completion_cap, self.n, entries)

    def body_for(self, backend):
        """Return the body (dict) ``backend`` is sent
        (:func:`gateway.contract.parameters.upstream_body`)."""
        return parameters.upstream_body(self, backend)

    @property
    def n_messages(self):
        return len(self.messages)

    @property
    def prompt_bound(self):
        """The most prompt tokens this request can have (the hold's bound)."""
        return prompt_bound(self.entry.context_window, self.body_bytes, len(self.messages),
                            self.has_images)


def validate_chat(body, catalog, body_bytes):
    """Check ``body`` against the contract and return a :class:`ChatRequest`.

    :param catalog: ``{model id: ModelEntry}``.
    :param body_bytes: size of the raw body (bounds the prompt for the hold).
    :raises InvalidRequest: 400, ``param`` naming the field at fault.
    :raises ModelNotFound: 404 ``model_not_found``.
    """
    entry = model_for(body, catalog, CHAT)
    messages = body.get("messages")
    if "image" not in entry.input:  # text only: the size alone decides, before any message
        _check_fits(entry, body_bytes)
    has_images = _messages(messages, entry)
    if not has_images:
        _check_fits(entry, body_bytes)
    checked = parameters.check(body, entry)
    return ChatRequest(entry=entry, messages=messages, body_bytes=body_bytes,
                       has_images=has_images, conversation_key=_conversation_key(messages),
                       image_lookups=_image_lookups(messages, entry) if has_images else (),
                       **checked)


def _image_lookups(messages, entry):
    """The :class:`gateway.contract.images.Lookup` of each image URL whose host is a name
    (the parts are valid: :func:`_messages` checked them)."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") != "image_url":
                continue
            value = part["image_url"]
            url = value.get("url") if isinstance(value, dict) else value
            if url[:5].lower() != "data:":
                found.append(images.check_image_url(value, f"messages[{i}].content[{j}]"
                                                    ".image_url", entry.image_sources,
                                                    entry.vouched_image_hosts))
    return tuple(lookup for lookup in found if lookup is not None)


_MODEL_MEMBER = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')


def refuse_unfit_before_parsing(raw, catalog):
    """Refuse a body too large for its text-only model's context window before it is parsed.

    Inside a JSON string a quote is always escaped, so ``"model":`` in the raw text is a
    member name; when it occurs exactly once it is the body's own ``model`` (else this check
    leaves the body to the parse and :func:`validate_chat`).

    :raises InvalidRequest: 400 ``context_length_exceeded``.
    """
    if raw.count(b'"model"') != 1:
        return
    match = _MODEL_MEMBER.search(raw)
    entry = catalog.get(match.group(1).decode("utf-8", "replace")) if match else None
    if entry is not None and "image" not in entry.input:
        _check_fits(entry, len(raw))


def _check_fits(entry, body_bytes):
    if body_bytes > entry.context_window * MAX_BYTES_PER_TOKEN:
        # Certain to overflow the context window: refused here rather than after the model
        # server has spent its time tokenizing it (a single-slot server stalls for everyone).
        raise InvalidRequest(f"The request ({body_bytes} bytes) cannot fit the "
                             f"context window of model '{entry.id}' ({entry.context_window} "
                             f"tokens).",
                             param="messages", code="context_length_exceeded")


def model_for(body, catalog, endpoint):
    """Return the catalog entry of ``body``'s ``model``, which must serve ``endpoint``.

    :raises InvalidRequest: 400 ``unsupported_endpoint`` (``param: "model"``), in OpenAI's
        words where it has them (:data:`NOT_SERVED`), before any charge.
    :raises ModelNotFound: 404 ``model_not_found``.
    """
    entry = _model(body, catalog)
    if endpoint not in entry.endpoints:
        served = entry.endpoints[0]
        if endpoint == CHAT and COMPLETIONS in entry.endpoints:
            served = COMPLETIONS
        message = NOT_SERVED[endpoint] if endpoint != COMPLETIONS or CHAT in entry.endpoints \
            else "This model does not support the v1/completions endpoint. Did you mean to " \
                 "use {hint}?"
        raise InvalidRequest(message.format(hint=HINTS[served]), param="model",
                             code="unsupported_endpoint")
    return entry


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
        # OpenAI's own message for it, word for word.
        raise InvalidRequest("Invalid 'messages': the array must contain at least one message.",
                             param="messages", code="empty_array")
    if not isinstance(messages, list):
        raise InvalidRequest("Invalid 'messages': expected an array of messages.",
                             param="messages", code="invalid_type")
    if len(messages) > entry.context_window:
        # Every message costs at least one token of the chat template (its role's marker).
        raise InvalidRequest(f"The request's {len(messages)} messages cannot fit the context "
                             f"window of model '{entry.id}' ({entry.context_window} tokens).",
                             param="messages", code="context_length_exceeded")
    has_images = False
    for i, message in enumerate(messages):
        has_images |= _message(i, message, entry)
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            gevent.sleep(0)
    return has_images


def _message(i, message, entry):
    """Check one message by its role; return whether it holds an image part."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"Invalid '{where}': expected an object.", param=where,
                             code="invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"Invalid '{where}.role': {str(role)[:40]!r} is not one of "
                             f"{', '.join(ROLES)}.", param=f"{where}.role", code="invalid_value")
    refuse_unknown_keys(message, MESSAGE_KEYS[role], where)
    _optional_string(message, "name", where)
    if role == "assistant":
        return _assistant(message, where, entry)
    if role == "function":  # deprecated: a function's result, answered by name
        require_string(message.get("name"), f"{where}.name")
        if message.get("content") is not None:
            require_string(message.get("content"), f"{where}.content")
        return False
    if role == "tool":
        require_string(message.get("tool_call_id"), f"{where}.tool_call_id")
    return _content(message.get("content"), f"{where}.content", role, entry)


def _optional_string(message, name, where):
    if message.get(name) is not None:
        require_string(message[name], f"{where}.{name}")


def require_string(value, param):
    """Refuse a missing or non-string value of ``param`` (400 ``missing_required_parameter``,
    ``invalid_type``)."""
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{param}'.", param=param,
                             code="missing_required_parameter")
    if not isinstance(value, str):
        raise InvalidRequest(f"Invalid '{param}': expected a string.", param=param,
                             code="invalid_type")


def _content(content, param, role, entry):
    """Check a string or an array of content parts; return whether it holds an image."""
    if not isinstance(content, list):
        require_string(content, param)
        return False
    if not content:
        raise InvalidRequest(f"Invalid '{param}': the array must contain at least one part.",
                             param=param, code="empty_array")
    return any([_part(part, f"{param}[{j}]", role, entry) for j, part in enumerate(content)])


def _part(part, where, role, entry):
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequest(f"Invalid '{where}': expected a content part object with a "
                             f"'type'.", param=where, code="invalid_type")
    kind = part["type"]
    if kind not in ROLE_PARTS[role]:
        raise InvalidRequest(f"Invalid '{where}.type': {kind[:40]!r} is not a part type of "
                             f"{role} messages ({', '.join(sorted(ROLE_PARTS[role]))}).",
                             param=f"{where}.type", code="invalid_value")
    refuse_unknown_keys(part, PART_KEYS[kind], where)
    if part.get(CACHE_BREAKPOINT) is not None:
        _part_object(part[CACHE_BREAKPOINT], CACHE_BREAKPOINT, where)
    modality = PART_MODALITY.get(kind)
    if modality and modality not in entry.input:
        # A text-only model ignores an image silently; refuse instead (docs/PARAMETERS.md).
        raise UnsupportedParameter(f"Invalid '{where}': model '{entry.id}' does not accept "
                                   f"{modality} input.", param=where)
    value = part.get(PART_FIELDS[kind])
    if kind in ("text", "refusal"):
        require_string(value, f"{where}.{kind}")
    elif kind == "image_url":
        images.check_image_url(value, f"{where}.image_url", entry.image_sources,
                               entry.vouched_image_hosts)
        if isinstance(value, dict):  # a bare URL string is accepted too
            _part_object(value, kind, where)
        return True
    else:
        _part_object(value, kind, where)
    return False


def _part_object(value, kind, where):
    """Check the object a part carries (``image_url``, ``input_audio``, ``file``, a cache
    breakpoint): an object of its known keys, each enumerated value one of its set."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"Invalid '{where}.{kind}': expected an object.",
                             param=f"{where}.{kind}", code="invalid_type")
    refuse_unknown_keys(value, PART_VALUE_KEYS[kind], f"{where}.{kind}")
    for key, item in value.items():
        allowed = PART_VALUES.get(f"{kind}.{key}")
        if allowed is not None and item is not None and item not in allowed:
            param = f"{where}.{kind}.{key}"
            raise InvalidRequest(f"Invalid '{param}': expected one of {', '.join(allowed)}.",
                                 param=param, code="invalid_value")


def _assistant(message, where, entry):
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        tools.check_tool_calls(tool_calls, f"{where}.tool_calls")
    if message.get("function_call") is not None:
        tools.check_function_call(message["function_call"], f"{where}.function_call")
    _optional_string(message, "refusal", where)
    audio = message.get("audio")
    if audio is not None and not (isinstance(audio, dict) and isinstance(audio.get("id"), str)):
        raise InvalidRequest(f"Invalid '{where}.audio': expected an object with an 'id'.",
                             param=f"{where}.audio", code="invalid_type")
    if audio is not None:
        refuse_unknown_keys(audio, {"id"}, f"{where}.audio")
    if message.get("content") is None:
        # A tool-call, function-call, refusal or audio reply: content may be null (OpenAI chat
        # API; docs/PARAMETERS.md, "Messages").
        if tool_calls or any(message.get(k) is not None
                             for k in ("function_call", "refusal", "audio")):
            return False
        raise InvalidRequest(f"Missing required parameter: '{where}.content' (an assistant "
                             f"message without tool calls needs content).",
                             param=f"{where}.content", code="missing_required_parameter")
    return _content(message["content"], f"{where}.content", "assistant", entry)


def _conversation_key(messages):
    """Return the conversation's stable prefix: its system prompt and first user turn."""
    head, seen_user = [], False
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("system", "developer") or (role == "user" and not seen_user):
            content = message.get("content")
            head.append(content if isinstance(content, str) else json.dumps(content))
            seen_user |= role == "user"
        if seen_user:
            break
    return "\n".join(head)
