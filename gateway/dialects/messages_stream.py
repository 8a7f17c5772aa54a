"""The answer side of ``POST /v1/messages``: an OpenAI chat completion (or its stream of
chunks, after Kiln's stop and tool rules) in Anthropic's shapes, and errors in its envelope.

Shapes follow Anthropic's Messages API reference and its streaming reference
(https://docs.claude.com/en/api/messages, https://docs.claude.com/en/docs/build-with-claude/streaming):
``message_start``, then per content block ``content_block_start``, ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``), ``content_block_stop``; then
``message_delta`` (stop reason, cumulative usage) and ``message_stop``; ``ping`` for keepalive;
a failure after the start is one ``error`` event and nothing after it. Usage carries Kiln's
``cost`` as an exact decimal literal, as chat's does (README, "Metering"; docs/MESSAGES.md).
"""
import json
import secrets

from ..backends.sse import dumps

# OpenAI's finish_reason -> Anthropic's stop_reason (a matched stop string is stop_sequence).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}
# Anthropic's error type for each status (https://docs.claude.com/en/api/errors); Kiln keeps
# its own status: 502 is the backend's failure (api_error), 503 Kiln's overload, maintenance or
# no free backend (overloaded_error, which Anthropic sends as 529), 504 a timeout.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               402: "billing_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
# Where a tool call's arguments are not a JSON object, the tool_use input keeps them under this
# key, as Anthropic's fine-grained tool streaming guide wraps invalid JSON
# (https://docs.claude.com/en/docs/agents-and-tools/tool-use/fine-grained-tool-streaming).
INVALID_JSON_KEY = "INVALID_JSON"
KEEPALIVE = b'event: ping\ndata: {"type": "ping"}\n\n'


def error_type(status):
    """Anthropic's error type for an HTTP status (other 4xx invalid_request_error, as
    Anthropic's reference says; other 5xx api_error)."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def error_object(err):
    """``{"type", "message"}`` for a :class:`gateway.errors.GatewayError`, with Kiln's own
    ``code`` and ``param`` (the names of Kiln's chat envelope) beside them."""
    out = {"type": error_type(err.status), "message": err.message}
    if err.code is not None:
        out["code"] = err.code
    if err.param is not None:
        out["param"] = err.param
    return out


def event(name, obj, cost_usd=None):
    """One server-sent event in Anthropic's framing: ``event: NAME`` then its ``data``."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj, cost_usd) + b"\n\n"


def usage_fields(usage):
    """Anthropic's usage of a :class:`gateway.billing.Usage`: input_tokens excludes the cache
    reads (they are cache_read_input_tokens); Kiln writes no cache (creation 0)."""
    out = {"input_tokens": usage.prompt - usage.cached, "output_tokens": usage.completion,
           "cache_read_input_tokens": usage.cached, "cache_creation_input_tokens": 0}
    if usage.estimated:
        out["estimated"] = True  # Kiln's own count (docs/METERING.md), as chat tells it
    return out


def stop_reason(finish, matched, tool_use, stops):
    """Return ``(stop_reason, stop_sequence)``.

    :param finish: the choice's finish_reason.
    :param matched: the stop string a model server says it matched (vLLM's ``stop_reason``,
        SGLang's ``matched_stop``), or None.
    :param tool_use: the answer holds a tool_use block.
    :param stops: the request's stop sequences.
    """
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    if tool_use:
        return "tool_use", None
    return STOP_REASONS.get(finish, "end_turn"), None


def matched_stop(choice):
    """The stop string a model server reports it stopped at, if any."""
    for key in ("stop_reason", "matched_stop"):
        if isinstance(choice.get(key), str):
            return choice[key]
    return None


def tool_input(arguments):
    """A tool call's arguments (JSON text) as the tool_use input object; arguments that are
    not a JSON object are kept as text under :data:`INVALID_JSON_KEY`."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        value = None
    return value if isinstance(value, dict) else {INVALID_JSON_KEY: str(arguments)}


def new_id(prefix):
    return prefix + secrets.token_hex(12)


def message_shell(message_id, model):
    """The message of ``message_start``: no content yet, usage told at the end."""
    return {"id": message_id, "type": "message", "role": "assistant", "content": [],
            "model": model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}


class MessagesStream:
    """Turn one generation's chat chunks into Anthropic's event stream.

    Only choice 0 is rendered (a Messages request asks for one). Tool-call fragments start a
    new tool_use block on a new ``index`` or a new ``id`` (some servers send every call at
    index 0, each with its own id); calls are assumed streamed one after another, as model
    servers stream them.
    """

    content_type = "text/event-stream"
    keepalive = KEEPALIVE

    def __init__(self, request):
        self.request = request
        self.message_id = new_id("msg_")
        self.started = False
        self.index = -1          # the current content block's index
        self.open = None         # the open block's kind: "text", "thinking", "tool_use"
        self.tool = None         # the open tool_use block's (fragment index, id)
        self.tool_blocks = 0
        self.finish = None
        self.matched = None

    def head(self):
        """The events sent as the stream's head leaves: ``message_start`` and a ``ping``."""
        return b"" if self.started else self._start()

    def _start(self):
        self.started = True
        return (event("message_start", {"type": "message_start",
                                        "message": message_shell(self.message_id,
                                                                 self.request.entry.id)})
                + event("ping", {"type": "ping"}))

    def _close(self):
        if self.open is None:
            return b""
        self.open, self.tool = None, None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _begin(self, kind, block):
        out = self._close()
        self.index += 1
        self.open = kind
        return out + event("content_block_start", {"type": "content_block_start",
                                                   "index": self.index, "content_block": block})

    def _delta(self, delta):
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": delta})

    def chunk(self, payload, obj):
        """The events one chat chunk (after Kiln's rules) becomes; b"" for a usage-only one."""
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list) or not choices:
            return b""
        out = [] if self.started else [self._start()]
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                out.extend(self._choice(choice))
        return b"".join(out)

    def _choice(self, choice):
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            if self.open != "thinking":
                yield self._begin("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": reasoning})
        content = delta.get("content")
        if isinstance(content, str) and content:
            if self.open != "text":
                yield self._begin("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": content})
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                yield from self._tool_fragment(call)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.matched = matched_stop(choice) or self.matched

    def _tool_fragment(self, call):
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        index, call_id = call.get("index", 0), call.get("id")
        if (self.open != "tool_use" or self.tool[0] != index
                or (isinstance(call_id, str) and call_id and call_id != self.tool[1])):
            call_id = call_id if isinstance(call_id, str) and call_id else new_id("toolu_")
            name = function.get("name") if isinstance(function.get("name"), str) else ""
            yield self._begin("tool_use", {"type": "tool_use", "id": call_id, "name": name,
                                           "input": {}})
            self.tool = (index, call_id)
            self.tool_blocks += 1
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            yield self._delta({"type": "input_json_delta", "partial_json": arguments})

    def end(self, usage, charged_usd, relayed):
        """The last events of a complete stream: open blocks closed, ``message_delta`` with
        the stop reason and the cumulative usage with ``cost`` (the USD charged), then
        ``message_stop``.

        :param relayed: the stream's :class:`gateway.flow.rules.StreamRules`: ``cut`` (Kiln
            stopped the generation at its budget: stop_reason max_tokens) and
            ``matched_stops`` (the stop string Kiln cut a choice at).
        """
        out = b"" if self.started else self._start()
        out += self._close()
        if relayed.cut:
            reason, sequence = "max_tokens", None
        else:
            matched = relayed.matched_stops.get(0) or self.matched
            reason, sequence = stop_reason(self.finish, matched, self.tool_blocks > 0,
                                           self.request.stop)
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage_fields(usage)}
        out += event("message_delta", delta, charged_usd)
        return out + event("message_stop", {"type": "message_stop"})

    def error(self, err):
        """The one ``error`` event that ends a failed stream (no ``message_stop`` after it)."""
        return event("error", {"type": "error", "error": error_object(err)})
