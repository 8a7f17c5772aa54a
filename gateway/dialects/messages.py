"""The Anthropic Messages codec: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages body becomes Kiln's canonical request through the chat contract
(:mod:`.messages_request`); the flow admits, routes, meters and settles it as any generation;
the answer is rendered in Anthropic's shapes here and in :mod:`.messages_stream`. The mapping,
field by field, is docs/MESSAGES.md; the shapes are Anthropic's Messages API reference
(https://docs.claude.com/en/api/messages).
"""
from ..backends.sse import dumps
from .messages_request import (MAX_TOKENS_LOWERED_HEADER, count_input_tokens,  # noqa: F401
                               parse_messages)
from .messages_stream import (MessagesStream, error_object, matched_stop, new_id, stop_reason,
                              tool_input, usage_fields)


class MessagesCodec:
    """Parse a Messages request, render its answer and its errors in Anthropic's shapes."""

    name = "messages"  # the usage event's endpoint

    def parse(self, body, catalog, body_bytes):
        """Return the :class:`gateway.contract.validation.ChatRequest` of a Messages body;
        ``response_headers`` holds :data:`MAX_TOKENS_LOWERED_HEADER` when max_tokens was
        lowered to the model's maximum output.

        :raises GatewayError: 400 naming the field in Anthropic's terms; 404 unknown model.
        """
        return parse_messages(body, catalog, body_bytes)

    def count_tokens(self, body, catalog, body_bytes, count):
        """The body of ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``.

        :param count: ``text -> int | None``, the backend's tokenizer (None: Kiln's estimate).
        """
        return {"input_tokens": count_input_tokens(body, catalog, body_bytes, count)}

    def error_body(self, err):
        """Return ``(HTTP status, Anthropic error envelope)`` for a
        :class:`gateway.errors.GatewayError`: Kiln's status, Anthropic's type for it, Kiln's
        ``code`` and ``param`` in the error object; ``request_id`` is the generation id when
        one was admitted."""
        body = {"type": "error", "error": error_object(err)}
        gid = err.headers.get("X-Neocloud-Generation-Id")
        if gid:
            body["request_id"] = gid
        return err.status, body

    def render_json(self, completion, usage, charged_usd, request, stops_hit=None):
        """Return the Anthropic message (JSON bytes) of a chat completion (after Kiln's stop and
        tool rules), with the usage billed and ``usage.cost`` the USD charged, exact.

        :param stops_hit: ``{choice index: stop string}`` Kiln cut at: the ``stop_sequence``.
        """
        choices = completion.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        content = _blocks(message)
        matched = (stops_hit or {}).get(choice.get("index", 0)) or matched_stop(choice)
        reason, sequence = stop_reason(choice.get("finish_reason"), matched,
                                       any(b["type"] == "tool_use" for b in content),
                                       request.stop)
        out = {"id": new_id("msg_"), "type": "message", "role": "assistant",
               "content": content, "model": request.entry.id, "stop_reason": reason,
               "stop_sequence": sequence, "usage": usage_fields(usage)}
        return dumps(out, charged_usd)

    def stream_renderer(self, request):
        return MessagesStream(request)


def _blocks(message):
    """The content blocks of a chat message: thinking (its reasoning), text, tool_use."""
    blocks = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, list):  # text parts
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    if not text and isinstance(message.get("refusal"), str):
        text = message["refusal"]
    if isinstance(text, str) and text:
        blocks.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        call_id = call.get("id")
        blocks.append({"type": "tool_use",
                       "id": call_id if isinstance(call_id, str) and call_id else new_id("toolu_"),
                       "name": function.get("name") or "",
                       "input": tool_input(function.get("arguments"))})
    return blocks
