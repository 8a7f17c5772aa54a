"""The chat completions dialect (``POST /v1/chat/completions``): the first codec, and the one
every chat-like codec's backend speaks.

In: the client's body, checked against the contract (:func:`gateway.contract.validation.
validate_chat`), is Kiln's canonical request as it is. Out: the backend's chat completion or
chunks after Kiln's rules (:mod:`gateway.flow.rules`), with Kiln's usage and ``usage.cost``;
errors in the OpenAI envelope (message, type, param, code: README, "API"). A codec renders; it
never decides a status, a usage or a cost.
"""
import json

from ..backends.sse import DONE, KEEPALIVE, dumps, frame, with_cost
from ..contract.validation import validate_chat
from ..flow.metering import is_well_formed

EVENT_STREAM = "text/event-stream"


class ChatCodec:
    """Chat completions in and out: the contract's checks, OpenAI's shapes."""

    name = "chat"

    def parse(self, body, catalog, body_bytes):
        """Return the canonical request for ``body`` (:class:`~gateway.contract.validation.
        ChatRequest`).

        :raises GatewayError: 400, 404 as :func:`~gateway.contract.validation.validate_chat`.
        """
        return validate_chat(body, catalog, body_bytes)

    def error_body(self, err):
        """Return ``(HTTP status, JSON object)`` of a refusal in the OpenAI envelope."""
        return err.status, err.envelope()

    def render_json(self, completion, usage, charged_usd, request, stops_hit=None):
        """Return the JSON body of a whole answer: the backend's completion (after Kiln's
        rules) with the billed usage where the backend's was not well formed, and
        ``usage.cost``, the USD charged (exact decimal).

        :param completion: the chat completion (dict); its ``usage`` is replaced when ``usage``
            (:class:`~gateway.billing.Usage`, what is billed) is not what it says.
        :param stops_hit: ``{choice index: stop string}`` Kiln cut at (chat says only
            ``finish_reason: "stop"``, as OpenAI does).
        """
        if not is_well_formed(completion.get("usage"), usage):
            completion["usage"] = usage_object(usage)
        return dumps(completion, charged_usd)

    def stream_renderer(self, request):
        return ChatStream(request)


class ChatStream:
    """A chat completion's event stream: each chunk relayed as its own ``data:`` event, then
    Kiln's end (the ``length`` chunk when Kiln cut the generation, the usage chunk when the
    client asked for it, ``[DONE]``), or one error event and no ``[DONE]``."""

    content_type = EVENT_STREAM
    keepalive = KEEPALIVE

    def __init__(self, request):
        self.include_usage = request.include_usage

    def head(self):
        """Return what the stream sends as its head leaves: nothing, in chat."""
        return b""

    def chunk(self, payload, obj):
        """Return the event of one chunk: its payload as relayed (exact bytes)."""
        return frame(payload)

    def end(self, usage, charged_usd, relayed):
        """Return the last bytes of a complete stream.

        :param relayed: the stream's :class:`~gateway.flow.rules.StreamRules` (what was
            relayed: its ids, the choices left open, the backend's usage chunk, Kiln's cut).
        """
        tail = _length_frame(relayed) if relayed.cut else b""
        if self.include_usage:
            tail += _usage_frame(relayed, usage, charged_usd)
        return tail + frame(DONE)

    def error(self, err):
        """Return the one event that ends a failed stream: the error envelope, no ``[DONE]``."""
        return frame(json.dumps(err.envelope()).encode())


def usage_object(usage):
    """Return the OpenAI usage object of ``usage`` (``estimated`` when Kiln counted)."""
    out = usage.to_openai()
    if usage.estimated:
        out["estimated"] = True
    return out


def _length_frame(relayed):
    """The chunk that ends every open choice with ``finish_reason: "length"`` (Kiln stopped the
    generation at its budget)."""
    chunk = {"id": relayed.chunk_id, "object": "chat.completion.chunk",
             "created": relayed.created, "model": relayed.model,
             "choices": [{"index": i, "delta": {}, "finish_reason": "length"}
                         for i in relayed.open_choices()]}
    return frame(dumps(chunk))


def _usage_frame(relayed, usage, cost_usd):
    """The usage chunk the client asked for: the billed counts with ``cost``; the backend's own
    chunk with only ``cost`` added when its usage is the one billed."""
    held = relayed.usage_payload
    if held is not None and is_well_formed(relayed.meter.reported, usage):
        priced = with_cost(held, cost_usd)
        if priced is not None:
            return frame(priced)
    chunk = json.loads(held) if held is not None else None
    if not isinstance(chunk, dict):
        chunk = {"id": relayed.chunk_id, "object": "chat.completion.chunk",
                 "created": relayed.created, "model": relayed.model, "choices": []}
    chunk["usage"] = usage_object(usage)
    return frame(dumps(chunk, cost_usd))


CODEC = ChatCodec()
