"""``POST /v1/responses``, the answer: a chat completion (after Kiln's stop and tool rules) as a
Response object, and a chat stream as the Responses API's typed events.

Shapes follow OpenAI's API reference: "The response object" and "Streaming events"
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.completed`` / ``response.incomplete`` / ``response.failed``, ``error``), each event
with its ``type`` and a ``sequence_number`` counting from 0, framed as
``event: <type>`` + ``data: <json>``. Money is written as an exact decimal literal in
``usage.cost`` (:func:`gateway.backends.sse.dumps`), never through a float.
"""
import json
import time
from decimal import Decimal

from ..backends.sse import KEEPALIVE, dumps
from .responses_request import new_id

REASONING_FIELDS = ("reasoning_content", "reasoning")
# The Response error codes of OpenAI's reference that Kiln's endings can be told as; any other
# ending is a ``server_error`` (the envelope's own code goes in the ``error`` event).
ERROR_CODES = {"rate_limit_exceeded": "rate_limit_exceeded"}


def response_object(request, output, status, usage=None, error=None, incomplete=None):
    """Return a Response object (dict) for ``request`` with ``output`` items."""
    obj = {"id": request.response_id, "object": "response", "created_at": request.created_at,
           "status": status, "error": error,
           "incomplete_details": {"reason": incomplete} if incomplete else None,
           "model": request.entry.id, "output": output,
           **request.echo, "store": request.store,
           "previous_response_id": request.previous_response_id,
           "completed_at": int(time.time()) if status == "completed" else None,
           "usage": usage}
    if request.dropped_tools:
        obj["dropped_tools"] = request.dropped_tools
    return obj


def usage_object(usage, reasoning_tokens=0):
    """Return the Responses ``usage`` (without cost) of a :class:`gateway.billing.Usage`."""
    out = {"input_tokens": usage.prompt,
           "input_tokens_details": {"cached_tokens": usage.cached, "cache_write_tokens": 0},
           "output_tokens": usage.completion,
           "output_tokens_details": {
               "reasoning_tokens": min(reasoning_tokens, usage.completion)},
           "total_tokens": usage.prompt + usage.completion}
    if usage.estimated:
        out["estimated"] = True
    return out


def reasoning_tokens_of(usage):
    """Return the reasoning tokens a backend's chat usage reports, or 0 when it reports none
    that is a whole non-negative number."""
    details = usage.get("completion_tokens_details") if isinstance(usage, dict) else None
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _reported_reasoning(relayed):
    """The reasoning tokens the backend reported in a stream: in its usage-only chunk (held by
    the flow, never passed to :meth:`ResponsesStream.chunk`) or its last running usage."""
    found = 0
    payload = getattr(relayed, "usage_payload", None)
    if payload:
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            found = reasoning_tokens_of(obj.get("usage"))
    meter = getattr(relayed, "meter", None)
    return max(found, reasoning_tokens_of(getattr(meter, "reported", None)))


def _incomplete_reason(finish_reason, cut=False):
    if cut or finish_reason == "length":
        return "max_output_tokens"
    if finish_reason == "content_filter":
        return "content_filter"
    return None


def render_json(completion, usage, charged_usd, request):
    """Return the Response object's bytes for a non-stream chat ``completion``."""
    choices = completion.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    reason = _incomplete_reason(choice.get("finish_reason"))
    item_status = "incomplete" if reason else "completed"
    output = []
    reasoning = next((message[k] for k in REASONING_FIELDS
                      if isinstance(message.get(k), str) and message[k]), None)
    if reasoning is not None:
        output.append(_reasoning_item(new_id("rs_"), reasoning, item_status))
    parts = []
    if isinstance(message.get("content"), str) and message["content"]:
        parts.append(_text_part(message["content"]))
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        parts.append({"type": "refusal", "refusal": message["refusal"]})
    if parts:
        output.append(_message_item(new_id("msg_"), parts, item_status))
    seen = set()
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        call_id = _unique_call_id(call.get("id"), seen)
        output.append(_call_item(new_id("fc_"), call_id, function.get("name") or "",
                                 function.get("arguments") or "", item_status))
    obj = response_object(request, output, "incomplete" if reason else "completed",
                          usage_object(usage, reasoning_tokens_of(completion.get("usage"))),
                          incomplete=reason)
    return dumps(obj, charged_usd)


def _unique_call_id(call_id, seen):
    if not isinstance(call_id, str) or not call_id or call_id in seen:
        call_id = new_id("call_")
    seen.add(call_id)
    return call_id


def _text_part(text):
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id, parts, status):
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": parts}


def _reasoning_item(item_id, text, status):
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text is not None else []}


def _call_item(item_id, call_id, name, arguments, status):
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class _Item:
    """One output item being streamed: its index, id, kind, and text so far."""

    def __init__(self, index, kind, item_id):
        self.index, self.kind, self.id = index, kind, item_id
        self.parts = []       # message: [["output_text" | "refusal", text]]
        self.text = ""        # reasoning text; function call arguments
        self.call_id = self.name = self.backend_id = None
        self.open = True


class ResponsesStream:
    """The typed events of one streamed response, from the chat chunks the flow relays.

    Items are opened as their first delta arrives (reasoning, a message, each function call)
    and closed, with their ``.done`` events, when another kind of item begins or at the end;
    function calls stay open until the end, as fragments of several calls may interleave.
    A new tool call is a new ``index`` or, at a known index, a new ``id`` (servers that send
    every call at index 0).
    """

    content_type = "text/event-stream"
    keepalive = KEEPALIVE

    def __init__(self, request):
        self.request = request
        self.seq = 0
        self.started = False
        self.items = []           # every output item, in output_index order
        self.current = None       # the open reasoning or message item
        self.calls = {}           # chat tool-call index -> its function_call item
        self.call_ids = set()
        self.finish_reason = None
        self.reasoning_tokens = 0
        self._final = None

    # -- framing ---------------------------------------------------------------------------

    def _event(self, kind, **fields):
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    def _lifecycle(self, kind, response, cost=None):
        body = dumps(response, cost) if cost is not None else dumps(response)
        head = dumps({"type": kind, "sequence_number": self.seq})
        self.seq += 1
        return (b"event: " + kind.encode() + b"\ndata: " + head[:-1] + b',"response":' + body
                + b"}\n\n")

    def head(self):
        """The events sent as the stream's head leaves: ``response.created`` and
        ``response.in_progress``, as OpenAI sends them at once."""
        return self._start()

    def _start(self):
        if self.started:
            return b""
        self.started = True
        snapshot = response_object(self.request, [], "in_progress")
        return (self._lifecycle("response.created", snapshot)
                + self._lifecycle("response.in_progress", snapshot))

    # -- chunks ----------------------------------------------------------------------------

    def chunk(self, payload, obj):
        """Return the events for one chat chunk (``obj``, its parsed ``payload``)."""
        out = [self._start()]
        self.reasoning_tokens = max(self.reasoning_tokens, reasoning_tokens_of(obj.get("usage")))
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # a Response has one output; n is always 1
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            for name in REASONING_FIELDS:
                if isinstance(delta.get(name), str) and delta[name]:
                    out.append(self._reasoning(delta[name]))
                    break
            if isinstance(delta.get("content"), str) and delta["content"]:
                out.append(self._text("output_text", delta["content"]))
            if isinstance(delta.get("refusal"), str) and delta["refusal"]:
                out.append(self._text("refusal", delta["refusal"]))
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out.append(self._call(call))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _open(self, kind, prefix, item):
        it = _Item(len(self.items), kind, new_id(prefix))
        self.items.append(it)
        return it, self._event("response.output_item.added", output_index=it.index,
                               item=item(it))

    def _reasoning(self, text):
        out = b""
        if self.current is None or self.current.kind != "reasoning":
            out += self._close_current()
            self.current, added = self._open("reasoning", "rs_", lambda it: _reasoning_item(
                it.id, None, "in_progress"))
            out += added + self._event("response.content_part.added", item_id=self.current.id,
                                       output_index=self.current.index, content_index=0,
                                       part={"type": "reasoning_text", "text": ""})
        self.current.text += text
        return out + self._event("response.reasoning_text.delta", item_id=self.current.id,
                                 output_index=self.current.index, content_index=0, delta=text)

    def _text(self, kind, text):
        out = b""
        if self.current is None or self.current.kind != "message":
            out += self._close_current()
            self.current, added = self._open("message", "msg_", lambda it: _message_item(
                it.id, [], "in_progress"))
            out += added
        it = self.current
        if not it.parts or it.parts[-1][0] != kind:
            it.parts.append([kind, ""])
            empty = _text_part("") if kind == "output_text" else {"type": "refusal",
                                                                   "refusal": ""}
            out += self._event("response.content_part.added", item_id=it.id,
                               output_index=it.index, content_index=len(it.parts) - 1,
                               part=empty)
        it.parts[-1][1] += text
        index = len(it.parts) - 1
        if kind == "output_text":
            return out + self._event("response.output_text.delta", item_id=it.id,
                                     output_index=it.index, content_index=index, delta=text,
                                     logprobs=[])
        return out + self._event("response.refusal.delta", item_id=it.id, output_index=it.index,
                                 content_index=index, delta=text)

    def _call(self, fragment):
        index = fragment.get("index", 0)
        call_id = fragment.get("id")
        function = fragment.get("function") if isinstance(fragment.get("function"), dict) else {}
        it, out = self.calls.get(index), b""
        given = call_id if isinstance(call_id, str) and call_id else None
        if it is None or (given is not None and it.backend_id is not None
                          and given != it.backend_id):
            out += self._close_current()
            unique = _unique_call_id(given, self.call_ids)
            name = function.get("name") if isinstance(function.get("name"), str) else ""
            it, added = self._open("function_call", "fc_", lambda item: _call_item(
                item.id, unique, name, "", "in_progress"))
            it.call_id, it.name, it.backend_id = unique, name, given
            self.calls[index] = it
            out += added
        else:
            if it.backend_id is None and given is not None:
                it.backend_id = given
            if not it.name and isinstance(function.get("name"), str):
                it.name = function["name"]  # a server that names the call after its first part
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            it.text += arguments
            out += self._event("response.function_call_arguments.delta", item_id=it.id,
                               output_index=it.index, delta=arguments)
        return out

    # -- closing -----------------------------------------------------------------------------

    def _close_current(self):
        it, self.current = self.current, None
        return self._close(it) if it is not None else b""

    def _close(self, it, status="completed"):
        it.open = False
        out = b""
        if it.kind == "reasoning":
            out += self._event("response.reasoning_text.done", item_id=it.id,
                               output_index=it.index, content_index=0, text=it.text)
            out += self._event("response.content_part.done", item_id=it.id,
                               output_index=it.index, content_index=0,
                               part={"type": "reasoning_text", "text": it.text})
        elif it.kind == "message":
            for j, (kind, text) in enumerate(it.parts):
                if kind == "output_text":
                    out += self._event("response.output_text.done", item_id=it.id,
                                       output_index=it.index, content_index=j, text=text,
                                       logprobs=[])
                    part = _text_part(text)
                else:
                    out += self._event("response.refusal.done", item_id=it.id,
                                       output_index=it.index, content_index=j, refusal=text)
                    part = {"type": "refusal", "refusal": text}
                out += self._event("response.content_part.done", item_id=it.id,
                                   output_index=it.index, content_index=j, part=part)
        else:
            out += self._event("response.function_call_arguments.done", item_id=it.id,
                               output_index=it.index, arguments=it.text)
        it.status = status
        return out + self._event("response.output_item.done", output_index=it.index,
                                 item=self._item(it, status))

    def _item(self, it, status):
        if it.kind == "reasoning":
            return _reasoning_item(it.id, it.text, status)
        if it.kind == "message":
            return _message_item(it.id, [_text_part(t) if k == "output_text"
                                         else {"type": "refusal", "refusal": t}
                                         for k, t in it.parts], status)
        return _call_item(it.id, it.call_id, it.name, it.text, status)

    def _close_all(self, status):
        out = self._close_current()
        for it in self.items:
            if it.open:
                out += self._close(it, status)
        return out

    def end(self, usage, charged_usd, relayed):
        """Return the closing events and ``response.completed`` (or ``response.incomplete``
        when Kiln cut the generation at its budget or the backend stopped at its length).

        :param relayed: the stream's :class:`gateway.flow.rules.StreamRules` (``cut``: Kiln
            stopped the generation at its budget; the backend's held usage-only chunk and its
            last usage, which tell ``output_tokens_details.reasoning_tokens`` when the backend
            reported them)."""
        out = self._start()
        self.reasoning_tokens = max(self.reasoning_tokens, _reported_reasoning(relayed))
        reason = _incomplete_reason(self.finish_reason, relayed.cut)
        item_status = "incomplete" if reason else "completed"
        out += self._close_all(item_status)
        output = [self._item(it, item_status) for it in self.items]
        self._final = response_object(self.request, output,
                                      "incomplete" if reason else "completed",
                                      usage_object(usage, self.reasoning_tokens),
                                      incomplete=reason)
        kind = "response.incomplete" if reason else "response.completed"
        out += self._lifecycle(kind, self._final, charged_usd)
        self._final = json.loads(dumps(self._final, charged_usd), parse_float=Decimal)
        return out

    def error(self, err):
        """Return the events of a failure after the stream began: an ``error`` event, then
        ``response.failed`` with the response so far (status ``failed``, its ``error``)."""
        out = self._start()
        out += self._close_all("incomplete")
        code = getattr(err, "code", None) or "server_error"
        message = getattr(err, "message", None) or str(err) or "The generation failed."
        out += self._event("error", code=code, message=message, param=getattr(err, "param", None))
        self._final = response_object(
            self.request, [self._item(it, "incomplete") for it in self.items], "failed",
            error={"code": ERROR_CODES.get(code, "server_error"), "message": message})
        return out + self._lifecycle("response.failed", self._final)

    def response(self):
        """Return the final Response object (dict), once :meth:`end` or :meth:`error` ran."""
        return self._final
