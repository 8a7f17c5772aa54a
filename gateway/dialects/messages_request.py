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
import re

from ..errors import GatewayError, UnsupportedParameter
from ..flow.metering import estimate_prompt
from ..contract.validation import validate_chat
from .messages_blocks import (as_int, as_number, as_object, as_string, check_cache_control,
                              invalid, one_of, refuse_extra, system_prompt, translate_message)

MAPPED, DROPPED = "mapped", "dropped"  # any other field is refused
UNSUPPORTED = "unsupported"  # in the reference, but a 400 when set: Kiln cannot do it
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
    # The beta Messages API's own fields (the SDK's ``client.beta.messages``, which Claude Code
    # uses: ``POST /v1/messages?beta=true``; the query string changes nothing here).
    "context_management": DROPPED, "mcp_servers": DROPPED, "fallbacks": DROPPED,
    "fallback_credit_token": DROPPED, "billing_policy": DROPPED,
    "compaction": UNSUPPORTED, "thread": UNSUPPORTED,
}
BETA_FIELDS = ("context_management", "mcp_servers", "fallbacks", "fallback_credit_token",
               "billing_policy", "compaction", "thread")
LEGACY_SAMPLING = ("temperature", "top_p", "top_k")
# ``POST /v1/messages/count_tokens`` takes the request without its generation settings
# (the SDK's ``MessageCountTokensParams``).
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking",
                "output_config", "cache_control", "speed", "user_profile_id", "workspace_id",
                # the beta API's (``MessageCountTokensParams`` of ``client.beta.messages``)
                "context_management", "mcp_servers", "billing_policy", "compaction")
# Why a field that Kiln cannot honour is refused rather than dropped.
UNSUPPORTED_WHY = {
    "compaction": "a compaction request asks Anthropic's server to summarise the conversation",
    "thread": "Kiln holds no conversation state between requests; send the whole conversation",
}

# The keys of a custom tool (the SDK's ``ToolParam``); any other typed tool is Anthropic's own.
CUSTOM_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict",
                    "allowed_callers", "defer_loading", "eager_input_streaming",
                    "input_examples"}
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
# The header saying max_tokens was lowered to the model's maximum output: "asked->held".
MAX_TOKENS_LOWERED_HEADER = "X-Kiln-Max-Tokens-Lowered"


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
        raise invalid("body", "Input should be an object", "invalid_type")
    refuse_extra(body, fields, "")
    body = {k: v for k, v in body.items() if v is not None}
    out = Translation()
    chat = out.chat
    model = body.get("model")
    if model is None:
        raise invalid("model", "Field required", "missing_required_parameter")
    chat["model"] = model
    entry = catalog.get(model) if isinstance(model, str) else None
    if "max_tokens" in fields:
        _max_tokens(body, entry, out)
    _sampling(body, entry, chat)
    _drop_checked(body, counting="max_tokens" not in fields)
    system = system_prompt(body.get("system"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "Input should be a non-empty list",
                       "missing_required_parameter" if messages is None else "invalid_type")
    if system is not None:
        out.origins.append(("system", [f"system.{i}" for i in range(len(system[1]))], []))
        chat["messages"] = [system[0]]
    else:
        chat["messages"] = []
    for i, item in enumerate(messages):
        translate_message(item, f"messages.{i}", out)
    offered = _tools(body.get("tools"), out)
    _tool_choice(body.get("tool_choice"), offered, out)
    _thinking(body, entry, out)
    _output_format(body.get("output_config"), chat)
    metadata = body.get("metadata")
    if metadata is not None:
        refuse_extra(as_object(metadata, "metadata"), {"user_id"}, "metadata")
        if metadata.get("user_id") is not None:
            chat["user"] = as_string(metadata["user_id"], "metadata.user_id")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", "Input should be a valid boolean", "invalid_type")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return out


def _max_tokens(body, entry, out):
    """``max_tokens`` is required; above the model's maximum output it is lowered to it (and
    said in :data:`MAX_TOKENS_LOWERED_HEADER`): agent clients ask for more than a self-hosted
    model's maximum whatever the model (docs/MESSAGES.md)."""
    if "max_tokens" not in body:
        raise invalid("max_tokens", "Field required", "missing_required_parameter")
    value = body["max_tokens"]
    if value == 0 and not isinstance(value, bool):
        raise UnsupportedParameter("max_tokens: 0 (warming Anthropic's prompt cache without a "
                                   "reply) is not supported: prefix caching is the model "
                                   "server's own.", param="max_tokens")
    asked = as_int(value, "max_tokens", 1)
    held = asked if entry is None else min(asked, entry.max_output_tokens)
    if held != asked:
        out.headers[MAX_TOKENS_LOWERED_HEADER] = f"{asked}->{held}"
    out.chat["max_tokens"] = held


def _sampling(body, entry, chat):
    if "temperature" in body:  # Anthropic's range is 0..1 (OpenAI's 0..2)
        chat["temperature"] = as_number(body["temperature"], "temperature", 0, 1)
    if "top_p" in body:
        chat["top_p"] = as_number(body["top_p"], "top_p", 0, 1)
    if "top_k" in body:
        top_k = as_int(body["top_k"], "top_k", 0)
        if entry is not None and "top_k" in entry.extra_params:
            chat["top_k"] = top_k  # the catalog forwards it to every backend of the model
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("stop_sequences", "Input should be a list of non-empty strings",
                           "invalid_type")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid("stop_sequences", f"Kiln takes at most {MAX_STOP_SEQUENCES} stop "
                           f"sequences (it enforces each on the output); {len(stops)} were sent")
        if stops:
            chat["stop"] = list(stops)


def _drop_checked(body, counting=False):
    """Check the fields that are accepted and dropped (their shape, as Anthropic would)."""
    if "service_tier" in body:
        one_of(body["service_tier"], SERVICE_TIERS, "service_tier")
    if "speed" in body:
        one_of(body["speed"], SPEEDS, "speed")
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        if name in body:
            as_string(body[name], name)
    check_cache_control(body.get("cache_control"), "cache_control")
    if "diagnostics" in body:
        refuse_extra(as_object(body["diagnostics"], "diagnostics"), {"previous_message_id"},
                      "diagnostics")
    container = body.get("container")
    if container is not None and not isinstance(container, str):
        refuse_extra(as_object(container, "container"), {"id", "skills"}, "container")
    _drop_checked_beta(body, counting)


def _drop_checked_beta(body, counting):
    """The beta API's fields: context editing (Claude Code sends ``clear_thinking`` edits:
    Kiln drops thinking blocks anyway and sends the conversation as given), MCP servers
    (Anthropic's connector; left out as offered server tools are), server-side fallbacks;
    billing someone else, compaction and server-held threads are refused (``count_tokens``
    ignores ``compaction``, as Anthropic's reference says)."""
    if "context_management" in body:
        edits = as_object(body["context_management"], "context_management").get("edits")
        if edits is not None:
            if not isinstance(edits, list):
                raise invalid("context_management.edits", "Input should be a list",
                              "invalid_type")
            for i, edit in enumerate(edits):
                as_string(as_object(edit, f"context_management.edits.{i}").get("type"),
                          f"context_management.edits.{i}.type")
    if "mcp_servers" in body and not isinstance(body["mcp_servers"], list):
        raise invalid("mcp_servers", "Input should be a list", "invalid_type")
    if "fallback_credit_token" in body:
        as_string(body["fallback_credit_token"], "fallback_credit_token")
    fallbacks = body.get("fallbacks")
    if fallbacks is not None and fallbacks != "default" and not isinstance(fallbacks, list):
        raise invalid("fallbacks", "Input should be a list or 'default'", "invalid_type")
    policy = body.get("billing_policy")
    if policy is not None:
        bill_to = as_object(policy, "billing_policy").get("bill_to", "self")
        if bill_to != "self":
            raise UnsupportedParameter("billing_policy: Kiln bills the organization of the "
                                       "API key; bill_to must be 'self'.",
                                       param="billing_policy.bill_to")
    for name, why in UNSUPPORTED_WHY.items():
        if name in body and not (counting and name == "compaction"):
            raise UnsupportedParameter(f"{name}: not supported by Kiln: {why}.", param=name)


def _tools(tools, out):
    """Custom tools become function tools; Anthropic's server and built-in tools (any typed
    tool but ``custom``) are left out of what the backend sees. Return ``(custom names,
    server names)``."""
    if tools is None:
        return set(), set()
    if not isinstance(tools, list):
        raise invalid("tools", "Input should be a list", "invalid_type")
    functions, custom, server = [], set(), set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        as_object(tool, where)
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            as_string(kind, f"{where}.type")
            server.add(tool.get("name") if isinstance(tool.get("name"), str) else kind)
            continue
        refuse_extra(tool, CUSTOM_TOOL_KEYS, where)
        check_cache_control(tool.get("cache_control"), f"{where}.cache_control")
        name = as_string(tool.get("name"), f"{where}.name", empty=False)
        schema = as_object(tool.get("input_schema"), f"{where}.input_schema")
        description = tool.get("description")
        if description is not None:
            as_string(description, f"{where}.description")
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
    as_object(choice, "tool_choice")
    kind = one_of(choice.get("type"), ("auto", "any", "tool", "none"), "tool_choice.type")
    keys = {"type"} | ({"disable_parallel_tool_use"} if kind != "none" else set()) | (
        {"name"} if kind == "tool" else set())
    refuse_extra(choice, keys, "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean",
                       "invalid_type")
    chat = out.chat
    if kind == "tool":
        name = as_string(choice.get("name"), "tool_choice.name", empty=False)
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
        as_object(thinking, "thinking")
        kind = one_of(thinking.get("type"), THINKING_TYPES, "thinking.type")
        refuse_extra(thinking, THINKING_KEYS[kind], "thinking")
        if thinking.get("display") is not None:
            one_of(thinking["display"], THINKING_DISPLAYS, "thinking.display")
        if kind == "enabled":
            budget = as_int(thinking.get("budget_tokens"), "thinking.budget_tokens",
                          MIN_THINKING_BUDGET)
            asked = body.get("max_tokens")
            if isinstance(asked, int) and budget >= asked:
                raise invalid("thinking.budget_tokens", "must be less than max_tokens "
                               f"({budget} >= {asked})")
            effort = next(e for bound, e in EFFORT_BY_BUDGET if bound is None or budget < bound)
    config = body.get("output_config")
    if config is not None:
        refuse_extra(as_object(config, "output_config"), {"effort", "format"}, "output_config")
        if config.get("effort") is not None:
            effort = one_of(config["effort"], EFFORTS, "output_config.effort")
            out.top["reasoning_effort"] = "output_config.effort"
    if effort and entry is not None and entry.family in REASONING_EFFORT_FAMILIES:
        out.chat["reasoning_effort"] = effort


def _output_format(config, chat):
    fmt = (config or {}).get("format")
    if fmt is None:
        return
    refuse_extra(as_object(fmt, "output_config.format"), {"type", "schema"},
                  "output_config.format")
    one_of(fmt.get("type"), ("json_schema",), "output_config.format.type")
    schema = as_object(fmt.get("schema"), "output_config.format.schema")
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
