"""The legacy completions dialect (``POST /v1/completions``, OpenAI's API reference:
https://platform.openai.com/docs/api-reference/completions): raw prompts in, ``text_completion``
objects and chunks out.

In: the client's body, checked against the contract (:func:`gateway.contract.legacy.
validate_completion`), is Kiln's canonical request. Out: the backend's text completion or chunks
after Kiln's rules (:mod:`gateway.flow.rules`: the budget and stop strings apply to ``text``),
with Kiln's usage and ``usage.cost``; errors in the OpenAI envelope. A codec renders; it never
decides a status, a usage or a cost.
"""
import json

from ..backends.sse import DONE, dumps, frame, with_cost
from ..contract.legacy import validate_completion
from ..flow.metering import is_well_formed
from .chat import ChatCodec, ChatStream, usage_object

TEXT_COMPLETION = "text_completion"


class CompletionsCodec(ChatCodec):
    """Completions in and out: the contract's checks, OpenAI's ``text_completion`` shapes.

    The whole answer is the backend's text completion with the billed usage, as chat's is."""

    name = "completions"

    def parse(self, body, catalog, body_bytes):
        """Return the canonical request for ``body`` (:class:`~gateway.contract.legacy.
        CompletionRequest`).

        :raises GatewayError: 400, 404 as :func:`~gateway.contract.legacy.validate_completion`.
        """
        return validate_completion(body, catalog, body_bytes)

    def stream_renderer(self, request):
        return CompletionStream(request)


class CompletionStream(ChatStream):
    """A text completion's event stream: each chunk relayed as its own ``data:`` event, then
    Kiln's end (a ``length`` chunk when Kiln cut the generation, the usage chunk when asked
    for, ``[DONE]``), or one error event and no ``[DONE]``."""

    def end(self, usage, charged_usd, relayed):
        tail = _length_frame(relayed) if relayed.cut else b""
        if self.include_usage:
            tail += _usage_frame(relayed, usage, charged_usd)
        return tail + frame(DONE)


def _chunk(relayed, choices):
    return {"id": relayed.chunk_id, "object": TEXT_COMPLETION, "created": relayed.created,
            "model": relayed.model, "choices": choices}


def _length_frame(relayed):
    """The chunk that ends every open choice with ``finish_reason: "length"``."""
    return frame(dumps(_chunk(relayed, [
        {"index": i, "text": "", "logprobs": None, "finish_reason": "length"}
        for i in relayed.open_choices()])))


def _usage_frame(relayed, usage, cost_usd):
    """The usage chunk: the backend's own with ``cost`` added when its usage is the one billed,
    else one with the billed counts."""
    held = relayed.usage_payload
    if held is not None and is_well_formed(relayed.meter.reported, usage):
        priced = with_cost(held, cost_usd)
        if priced is not None:
            return frame(priced)
    chunk = json.loads(held) if held is not None else None
    if not isinstance(chunk, dict):
        chunk = _chunk(relayed, [])
    chunk["usage"] = usage_object(usage)
    return frame(dumps(chunk, cost_usd))
