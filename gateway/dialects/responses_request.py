"""``POST /v1/responses``, the request: a Responses body rewritten as an OpenAI chat body, then
checked by the chat contract (:func:`gateway.contract.validation.validate_chat`), so that every
rule of chat (images, tools, lengths, capabilities) holds here too.

Every top-level field of OpenAI's Responses API reference ("Create a model response", as the
``openai`` SDK types it in ``responses.response_create_params``) has one row in :data:`FIELDS`:
rewritten into the chat body, accepted and dropped, or refused; docs/RESPONSES.md is the same
table in prose. Any other field is refused with 400 ``unknown_parameter`` as OpenAI refuses it,
unless the model's catalog entry allows it by name (``extra_params``, as for chat).

An error names the Responses field at fault (``input[2].content[0].image_url``), also when the
chat contract found it: :func:`translate` maps the chat path back through the origin of each
message.
"""
import json
import re
import secrets
import time
from dataclasses import dataclass, field

import orjson

from ..contract.validation import ChatRequest, require_string, validate_chat
from ..errors import InvalidRequest, UnknownParameter, UnsupportedParameter
from ..models import new_response_id

REWRITE, DROP, REFUSE = "rewritten", "dropped", "refused"
# What Kiln does with each field of the Responses reference (docs/RESPONSES.md).
FIELDS = {
    "model": REWRITE, "input": REWRITE, "instructions": REWRITE, "tools": REWRITE,
    "tool_choice": REWRITE, "parallel_tool_calls": REWRITE, "max_output_tokens": REWRITE,
    "temperature": REWRITE, "top_p": REWRITE, "reasoning": REWRITE, "text": REWRITE,
    "stream": REWRITE, "metadata": REWRITE, "user": REWRITE, "safety_identifier": REWRITE,
    "prompt_cache_key": REWRITE, "prompt_cache_retention": REWRITE, "service_tier": REWRITE,
    "store": REWRITE, "previous_response_id": REWRITE,
    "stream_options": DROP, "include": DROP, "truncation": DROP, "top_logprobs": DROP,
    "max_tool_calls": DROP, "prompt_cache_options": DROP, "context_management": DROP,
    "image": DROP, "access_programs": DROP, "background_options": DROP, "background": DROP,
    "conversation": REFUSE, "prompt": REFUSE, "moderation": REFUSE,
}
# Enumerations of the reference (the openai SDK's Literal types; the tests compare them).
INCLUDABLES = ("file_search_call.results", "web_search_call.results",
               "web_search_call.action.sources", "message.input_image.image_url",
               "computer_call_output.output.image_url", "code_interpreter_call.outputs",
               "reasoning.encrypted_content", "message.output_text.logprobs")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
TRUNCATIONS = ("auto", "disabled")
SUMMARIES = ("auto", "concise", "detailed")
REASONING_KEYS = ("effort", "summary", "generate_summary", "context", "mode")
TEXT_KEYS = ("format", "verbosity")
FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
               "json_schema": ("type", "name", "schema", "description", "strict")}
# A function tool (``FunctionToolParam``): what the backend is sent, and what is accepted and
# dropped (deferred loading and callers belong to OpenAI's hosted tool search).
FUNCTION_SENT = ("name", "description", "parameters", "strict")
FUNCTION_DROPPED = ("type", "allowed_callers", "defer_loading", "output_schema", "async")
# Tools OpenAI runs on its own platform (or, for ``custom``, ``namespace``, free-form or grouped
# tools the chat API of model servers cannot carry): left out of what the backend sees when
# offered, a 400 when ``tool_choice`` forces one.
HOSTED_TOOLS = ("file_search", "computer", "computer_use", "computer_use_preview", "web_search",
                "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                "mcp", "code_interpreter", "programmatic_tool_calling", "image_generation",
                "local_shell", "shell", "custom", "namespace", "tool_search", "apply_patch")
ROLES = ("user", "assistant", "system", "developer")
# Content part types per role, as OpenAI accepts them in input messages.
ROLE_PARTS = {"user": ("input_text", "input_image", "input_file"),
              "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "refusal", "input_text")}
MESSAGE_KEYS = ("type", "role", "content", "id", "status", "phase")
PART_KEYS = {"input_text": ("type", "text", "prompt_cache_breakpoint"),
             "input_image": ("type", "image_url", "file_id", "detail",
                             "prompt_cache_breakpoint"),
             "input_file": ("type", "file_data", "file_id", "file_url", "filename", "detail",
                            "prompt_cache_breakpoint"),
             "output_text": ("type", "text", "annotations", "logprobs"),
             "refusal": ("type", "refusal")}
CALL_KEYS = ("type", "call_id", "name", "arguments", "id", "status", "caller", "namespace",
             "async")
OUTPUT_KEYS = ("type", "call_id", "output", "id", "status", "caller", "name", "namespace")
# Items sent back that carry nothing a model server reads: reasoning (its text is the model's
# own, and OpenAI's encrypted form means nothing to another model) and compaction markers.
DROPPED_ITEMS = ("reasoning", "compaction", "compaction_trigger")
IMAGE_DETAILS = ("auto", "low", "high", "original")


def new_id(prefix):
    """Return a fresh object id (``resp_``, ``msg_``, ``fc_``, ``rs_``...), as OpenAI's look."""
    return prefix + secrets.token_hex(24)


@dataclass
class ResponsesRequest(ChatRequest):
    """A validated chat request, plus what the Responses dialect needs to answer and store it.

    :ivar response_id: ``resp_...``, fixed at parse (the stream's first event names it).
    :ivar echo: the request fields a Response object repeats (instructions, tools, ...).
    :ivar dropped_tools: ``[{"index", "type"}]`` of the hosted tools left out.
    :ivar input_items: this request's input, as items with ids (what ``input_items`` lists).
    :ivar store: keep the response (``store``, default true).
    :ivar previous_response_id: the response this one continues, or None.
    """

    response_id: str = ""
    created_at: int = 0
    echo: dict = field(default_factory=dict)
    dropped_tools: list = field(default_factory=list)
    input_items: list = field(default_factory=list)
    store: bool = True
    previous_response_id: str = None


def parse(body, catalog, body_bytes, history=None, store_default=True):
    """Check a Responses body and return a :class:`ResponsesRequest`.

    :param history: the input and output items of the ``previous_response_id`` chain, oldest
        first (already loaded; :mod:`gateway.ledger.responses`), prepended to ``input``.
    :param store_default: what an absent ``store`` means (OpenAI: true).
    :raises InvalidRequest: 400, ``param`` naming the Responses field.
    :raises ModelNotFound: 404.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("Invalid body: expected a JSON object.", code="invalid_type")
    body = {k: v for k, v in body.items() if v is not None}  # null is absent, as for chat
    entry = catalog.get(body["model"]) if isinstance(body.get("model"), str) else None
    extra = entry.extra_params if entry is not None else ()
    _check_fields(body, extra)
    _dropped_fields(body)
    b = _conversation(body, history)
    chat = {"model": body.get("model"), "messages": b.messages}
    tools, dropped = _tools(body.get("tools"), b)
    choice = _tool_choice(body.get("tool_choice"), tools, body.get("tools"))
    if choice is not None and choice[1] is not None:
        tools = choice[1]
    if tools:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice[0]
    _copy(body, chat)
    chat.update({k: body[k] for k in extra if k in body})
    if body.get("stream") not in (None, False):
        chat["stream"] = body["stream"]
        if chat["stream"] is True:
            chat["stream_options"] = {"include_usage": True}
    history_bytes = _json_size(history) if history else 0
    try:
        checked = validate_chat(chat, catalog, body_bytes + history_bytes)
    except InvalidRequest as err:
        raise translate(err, b) from None
    store = body.get("store", store_default)
    _bool(store, "store")
    previous = body.get("previous_response_id")
    if previous is not None:
        require_string(previous, "previous_response_id")
    return ResponsesRequest(
        # A stored response's id tells when it was made (a read may wait for its row); an
        # unstored one is random, so that naming it is a 404 at once (docs/RESPONSES.md).
        **vars(checked), response_id=new_response_id() if store else new_id("resp_"),
        created_at=int(time.time()),
        echo=_echo(body, tools, choice), dropped_tools=dropped, input_items=b.stored,
        store=store, previous_response_id=previous)


def _json_size(value):
    """Bytes of ``value`` as compact JSON (orjson; the standard library for what it refuses)."""
    try:
        return len(orjson.dumps(value, default=str))
    except TypeError:  # orjson.JSONEncodeError is one
        return len(json.dumps(value, separators=(",", ":"), default=str).encode())


def _check_fields(body, extra):
    """Refuse a field Responses does not define (or the model's extra parameters), one Kiln
    refuses (:data:`REFUSALS`), and a ``background`` response."""
    for name in body:
        if name not in FIELDS and name not in extra:
            raise UnknownParameter(name[:100], f"Unrecognized request argument supplied: "
                                               f"{name[:100]}")
        if FIELDS.get(name) == REFUSE:
            raise UnsupportedParameter(REFUSALS[name], param=name)
    if body.get("background") not in (None, False):
        raise UnsupportedParameter("'background' responses are not supported: Kiln answers in "
                                   "the request (use stream: true for long generations).",
                                   param="background")


def _conversation(body, history):
    """The chat messages of ``instructions``, the ``history`` items and ``input``, in order, in
    a flushed :class:`_Builder`."""
    b = _Builder()
    if body.get("instructions") is not None:
        require_string(body["instructions"], "instructions")
        b.add({"role": "developer", "content": body["instructions"]}, "instructions")
    for item in history or ():
        b.item(item, "previous_response_id", resolving=False)
    items = _input_items(body.get("input"))
    for i, item in enumerate(items):
        b.item(item, f"input[{i}]" if not isinstance(body.get("input"), str) else "input")
    b.flush()
    return b


REFUSALS = {
    "conversation": "'conversation' is not supported: Kiln keeps no conversations; continue "
                    "with previous_response_id instead.",
    "prompt": "'prompt' templates are not supported: Kiln stores no prompts; send the "
              "instructions and input themselves.",
    "moderation": "'moderation' is not supported: Kiln runs no moderation, and dropping it "
                  "would let a client believe its policy was applied.",
}


# -- the messages ---------------------------------------------------------------------------

class _Builder:
    """Chat messages from Responses items, and where each came from (for error params)."""

    def __init__(self):
        self.messages, self.origins = [], []  # origins[k]: (item path, [part paths] or None)
        self.stored = []   # this request's items, with ids, as stored and listed
        self.by_id = {}    # item id -> item (for item_reference)
        self.tool_paths = {}  # (message index, call index) -> item path
        self._pending = None  # an assistant message still collecting tool calls

    def add(self, message, origin, parts=None):
        self.flush()
        self.messages.append(message)
        self.origins.append((origin, parts))

    def flush(self):
        if self._pending is not None:
            message, origin, parts = self._pending
            self._pending = None
            self.messages.append(message)
            self.origins.append((origin, parts))

    def item(self, item, where, resolving=True):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            item = self._reference(item, where)
        if not isinstance(item, dict):
            raise InvalidRequest(f"Invalid '{where}': expected an object.", param=where,
                                 code="invalid_type")
        kind = item.get("type", "message")
        if resolving:
            item = _as_listed(item, kind)
            self.stored.append(item)
        if isinstance(item.get("id"), str):
            self.by_id[item["id"]] = item
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._output(item, where)
        elif kind in DROPPED_ITEMS:
            return
        elif not isinstance(kind, str):
            raise InvalidRequest(f"Invalid '{where}.type': expected a string.",
                                 param=f"{where}.type", code="invalid_type")
        else:
            raise UnsupportedParameter(
                f"Invalid '{where}': items of type '{kind[:60]}' come from tools Kiln does not "
                f"run; send their result as a message or a function_call_output.",
                param=f"{where}.type")

    def _reference(self, item, where):
        target = self.by_id.get(item.get("id"))
        if target is None:
            raise InvalidRequest(f"Item with id '{str(item.get('id'))[:80]}' not found.",
                                 param=f"{where}.id", code="invalid_value")
        return target

    def _message(self, item, where):
        _keys(item, MESSAGE_KEYS, where)
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"Invalid '{where}.role': expected one of "
                                 f"{', '.join(ROLES)}.", param=f"{where}.role",
                                 code="invalid_value")
        content = item.get("content")
        if isinstance(content, str):
            message, parts = {"role": role, "content": content}, None
        elif isinstance(content, list):
            parts = [f"{where}.content[{j}]" for j in range(len(content))]
            message = {"role": role, "content": [_part(p, path, role)
                                                 for p, path in zip(content, parts, strict=True)]}
        else:
            raise InvalidRequest(f"Invalid '{where}.content': expected a string or an array "
                                 f"of content parts.", param=f"{where}.content",
                                 code="invalid_type")
        if role == "assistant":
            self.flush()
            self._pending = (message, where, parts)
        else:
            self.add(message, where, parts)

    def _call(self, item, where):
        _keys(item, CALL_KEYS, where)
        for name in ("call_id", "name", "arguments"):
            require_string(item.get(name), f"{where}.{name}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if self._pending is None:
            self._pending = ({"role": "assistant", "content": None, "tool_calls": []}, where,
                             None)
        message = self._pending[0]
        message.setdefault("tool_calls", []).append(call)
        self.tool_paths[(len(self.messages), len(message["tool_calls"]) - 1)] = where

    def _output(self, item, where):
        _keys(item, OUTPUT_KEYS, where)
        require_string(item.get("call_id"), f"{where}.call_id")
        output = item.get("output")
        if isinstance(output, str):
            content, parts = output, None
        elif isinstance(output, list) and output:
            parts = [f"{where}.output[{j}]" for j in range(len(output))]
            content = [_part(p, path, "tool") for p, path in zip(output, parts, strict=True)]
        else:
            raise InvalidRequest(f"Invalid '{where}.output': expected a string or an array of "
                                 f"input_text parts.", param=f"{where}.output",
                                 code="invalid_type")
        self.add({"role": "tool", "tool_call_id": item["call_id"], "content": content}, where,
                 parts)


def _as_listed(item, kind):
    """Return ``item`` as OpenAI lists an input item (the reference's "List input items"): with
    an ``id``, a message with its ``type`` and its content as parts (a string becomes one
    ``input_text``, or ``output_text`` for the assistant), so the SDK's types read it back."""
    item = dict(item)
    item.setdefault("id", new_id(ITEM_PREFIX.get(kind, "item_")))
    if kind == "message":
        item["type"] = "message"
        if isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
    return item


ITEM_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
               "reasoning": "rs_"}


def _part(part, where, role):
    """Return the chat content part for one Responses content part."""
    kind = part.get("type") if isinstance(part, dict) else None
    allowed = ROLE_PARTS.get(role, ("input_text",))
    if kind not in allowed:
        raise InvalidRequest(f"Invalid '{where}.type': expected one of {', '.join(allowed)} in "
                             f"{role} content.", param=f"{where}.type", code="invalid_value")
    _keys(part, PART_KEYS[kind], where)
    if kind in ("input_text", "output_text"):
        require_string(part.get("text"), f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "refusal":
        require_string(part.get("refusal"), f"{where}.refusal")
        return {"type": "refusal", "refusal": part["refusal"]}
    if part.get("file_id") is not None:
        how = "the image as image_url" if kind == "input_image" else "the file as file_data"
        raise UnsupportedParameter(f"Invalid '{where}.file_id': Kiln has no Files API; send "
                                   f"{how} instead.", param=f"{where}.file_id")
    if kind == "input_image":
        require_string(part.get("image_url"), f"{where}.image_url")
        detail = part.get("detail", "auto")
        if detail not in IMAGE_DETAILS:
            raise InvalidRequest(f"Invalid '{where}.detail': expected one of "
                                 f"{', '.join(IMAGE_DETAILS)}.", param=f"{where}.detail",
                                 code="invalid_value")
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": detail}}
    if part.get("file_url") is not None:
        raise UnsupportedParameter(f"Invalid '{where}.file_url': send the file as file_data.",
                                   param=f"{where}.file_url")
    require_string(part.get("file_data"), f"{where}.file_data")
    out = {"file_data": part["file_data"]}
    if part.get("filename") is not None:
        out["filename"] = part["filename"]
    return {"type": "file", "file": out}


def _input_items(value):
    if isinstance(value, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]
    if value is None or value == []:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input",
                             code="missing_required_parameter")
    if not isinstance(value, list):
        raise InvalidRequest("Invalid 'input': expected a string or an array of items.",
                             param="input", code="invalid_type")
    return value


# -- tools ------------------------------------------------------------------------------------

def _tools(tools, builder):
    """Return ``(chat tools, dropped hosted tools)``."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise InvalidRequest("Invalid 'tools': expected an array.", param="tools",
                             code="invalid_type")
    out, dropped = [], []
    builder.tool_index = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            _keys(tool, FUNCTION_SENT + FUNCTION_DROPPED, f"tools[{i}]")
            function = {k: tool[k] for k in FUNCTION_SENT if tool.get(k) is not None}
            description = tool.get("description")
            if description is not None:
                require_string(description, f"tools[{i}].description")
            if not (description or "").strip() and isinstance(tool.get("name"), str):
                # Optional in OpenAI's reference (the Agents SDK sends none for an undocumented
                # function); the chat contract needs one, as model servers' templates render
                # it: the tool's name stands in, as for the Messages API.
                function["description"] = tool["name"]
            out.append({"type": "function", "function": function})
            builder.tool_index.append(i)
        elif isinstance(kind, str):
            dropped.append({"index": i, "type": kind})  # a hosted (or unknown) tool
        else:
            raise InvalidRequest(f"Invalid 'tools[{i}].type': expected a string.",
                                 param=f"tools[{i}].type", code="invalid_type")
    return out, dropped


def _tool_choice(choice, tools, sent):
    """Return ``(chat tool_choice, tools narrowed by allowed_tools or None)``, or None."""
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        return choice, None
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise InvalidRequest("Invalid 'tool_choice': expected 'auto', 'none', 'required' or an "
                             "object with a 'type'.", param="tool_choice", code="invalid_value")
    kind = choice["type"]
    if kind == "function":
        _keys(choice, ("type", "name"), "tool_choice")
        require_string(choice.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, None
    if kind == "allowed_tools":
        _keys(choice, ("type", "mode", "tools"), "tool_choice")
        mode, allowed = choice.get("mode"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise InvalidRequest("Invalid 'tool_choice': allowed_tools needs a mode (auto or "
                                 "required) and an array of tools.", param="tool_choice",
                                 code="invalid_value")
        names = {t.get("name") for t in allowed
                 if isinstance(t, dict) and t.get("type") == "function"}
        narrowed = [t for t in tools if t["function"]["name"] in names]
        if mode == "required" and not narrowed:
            raise _forced_hosted("tool_choice.tools", "the allowed tools")
        return mode, narrowed
    raise _forced_hosted("tool_choice", f"'{kind[:60]}'")


def _forced_hosted(param, what):
    return UnsupportedParameter(f"tool_choice forces {what}, a tool Kiln cannot run: Kiln's "
                                f"models call function tools only (the client runs them).",
                                param=param)


# -- the other fields -------------------------------------------------------------------------

def _copy(body, chat):
    """Write the fields chat reads under their chat names (checked there)."""
    for name in ("temperature", "top_p", "parallel_tool_calls", "metadata", "user",
                 "safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        if name in body:
            chat[name] = body[name]
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    if "service_tier" in body and body["service_tier"] not in SERVICE_TIERS:
        raise InvalidRequest(f"Invalid 'service_tier': expected one of "
                             f"{', '.join(SERVICE_TIERS)}.", param="service_tier",
                             code="invalid_value")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        _object(reasoning, "reasoning")
        _keys(reasoning, REASONING_KEYS, "reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
        for name in ("summary", "generate_summary"):
            if reasoning.get(name) not in (None, *SUMMARIES):
                raise InvalidRequest(f"Invalid 'reasoning.{name}': expected one of "
                                     f"{', '.join(SUMMARIES)}.", param=f"reasoning.{name}",
                                     code="invalid_value")
    text = body.get("text")
    if text is not None:
        _object(text, "text")
        _keys(text, TEXT_KEYS, "text")
        if text.get("verbosity") is not None:
            chat["verbosity"] = text["verbosity"]
        if text.get("format") is not None:
            chat["response_format"] = _format(text["format"])


def _format(fmt):
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMAT_KEYS:
        raise InvalidRequest("Invalid 'text.format.type': expected text, json_object or "
                             "json_schema.", param="text.format.type", code="invalid_value")
    _keys(fmt, FORMAT_KEYS[kind], "text.format")
    if kind != "json_schema":
        return {"type": kind}
    require_string(fmt.get("name"), "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("Invalid 'text.format.schema': expected a JSON Schema object.",
                             param="text.format.schema", code="invalid_type")
    return {"type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "description", "strict")
                            if fmt.get(k) is not None}}


def _dropped_fields(body):
    """Check the fields Kiln accepts and drops, so that a malformed one is still a 400."""
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or any(i not in INCLUDABLES for i in include):
            raise InvalidRequest(f"Invalid 'include': expected an array of "
                                 f"{', '.join(INCLUDABLES)}.", param="include",
                                 code="invalid_value")
    if body.get("truncation") not in (None, *TRUNCATIONS):
        raise InvalidRequest("Invalid 'truncation': expected auto or disabled.",
                             param="truncation", code="invalid_value")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise InvalidRequest("Invalid 'top_logprobs': expected an integer from 0 to 20.",
                             param="top_logprobs", code="invalid_value")
    calls = body.get("max_tool_calls")
    if calls is not None and (not _is_int(calls) or calls < 1):
        raise InvalidRequest("Invalid 'max_tool_calls': expected an integer of at least 1.",
                             param="max_tool_calls", code="invalid_value")
    for name in ("stream_options", "prompt_cache_options", "image", "access_programs",
                 "background_options"):
        if name in body:
            _object(body[name], name)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequest("Invalid 'stream_options': only allowed when 'stream' is true.",
                             param="stream_options", code="invalid_value")
    if "context_management" in body and not isinstance(body["context_management"], list):
        raise InvalidRequest("Invalid 'context_management': expected an array.",
                             param="context_management", code="invalid_type")


def _echo(body, tools, choice):
    """The request fields a Response object repeats, with OpenAI's defaults."""
    sent_tools = body.get("tools") or []
    kept = {t["function"]["name"] for t in tools}
    return {
        "instructions": body.get("instructions"),
        "tools": [t for t in sent_tools if isinstance(t, dict) and t.get("type") == "function"
                  and t.get("name") in kept],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata", {}),
        "text": {"format": {"type": "text"}, **(body.get("text") or {})},
        "reasoning": {"effort": None, "summary": None, **(body.get("reasoning") or {})},
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"), "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "service_tier": body.get("service_tier", "default"),
        "top_logprobs": body.get("top_logprobs", 0), "background": False,
    }


# -- errors found by the chat contract, in Responses words ------------------------------------

_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\](?:\.content\[(\d+)\]|\.tool_calls\[(\d+)\])?")
_TOOL_PATH = re.compile(r"^tools\[(\d+)\](?:\.function)?")
RENAMES = (("max_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"),
           ("response_format.json_schema", "text.format.schema"),
           ("response_format", "text.format"), ("verbosity", "text.verbosity"),
           ("messages", "input"))


def translate(err, builder):
    """Return ``err`` with its ``param`` (and the message's quote of it) in Responses terms."""
    param = err.param
    if not isinstance(param, str):
        return err
    new = _translate_param(param, builder)
    if new != param:
        err.message = err.message.replace(f"'{param}", f"'{new}")
        err.param = new
    return err


def _translate_param(param, builder):
    match = _MESSAGE_PATH.match(param)
    if match and int(match.group(1)) < len(builder.origins):
        k = int(match.group(1))
        origin, parts = builder.origins[k]
        rest = param[match.end():]
        if match.group(2) is not None and parts is not None:
            j = int(match.group(2))
            return (parts[j] if j < len(parts) else origin) + _part_rest(rest)
        if match.group(3) is not None:
            return builder.tool_paths.get((k, int(match.group(3))), origin)
        return origin + (".content" if rest.startswith(".content") else "")
    match = _TOOL_PATH.match(param)
    if match and int(match.group(1)) < len(getattr(builder, "tool_index", ())):
        return f"tools[{builder.tool_index[int(match.group(1))]}]" + param[match.end():]
    for old, new in RENAMES:
        if param == old or param.startswith(old + "."):
            return new + param[len(old):]
    return param


def _part_rest(rest):
    return rest.replace(".image_url.url", ".image_url").replace(".image_url.detail", ".detail") \
        .replace(".file.", ".")


# -- small checks -------------------------------------------------------------------------------

def _keys(obj, allowed, where):
    for key in obj:
        if key not in allowed:
            raise UnknownParameter(f"{where}.{str(key)[:100]}")


def _bool(value, param):
    if not isinstance(value, bool):
        raise InvalidRequest(f"Invalid '{param}': expected a boolean.", param=param,
                             code="invalid_type")


def _object(value, param):
    if not isinstance(value, dict):
        raise InvalidRequest(f"Invalid '{param}': expected an object.", param=param,
                             code="invalid_type")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
