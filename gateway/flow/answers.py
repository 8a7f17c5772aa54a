"""The two ways a generation's answer reaches its client: one JSON body, or an event stream.

Each path is a generator driven by :func:`gateway.flow.generation.respond`: it yields the
response's :class:`Head`, then body bytes, and returns its last bytes as a function of the USD
charged, which the flow sends after the settlement (docs/METERING.md). ``gen`` is the
:class:`gateway.flow.generation.Generation` being answered; nothing here touches the ledger.
"""
import json
from dataclasses import dataclass

from ..backends import upstream
from ..errors import UpstreamError
from .metering import is_well_formed
from .outcomes import check_complete
from ..backends.relay import Pump, keepalives_until_answered, relay_stream
from ..backends.sse import DONE, StreamRules, apply_to_completion, dumps, frame

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
EVENT_STREAM = upstream.EVENT_STREAM


@dataclass(frozen=True)
class Head:
    """The status line and headers of a generation's response."""

    status: int
    content_type: str
    headers: dict


# -- JSON ------------------------------------------------------------------------------------

def complete(gen):
    """Read the backend's whole reply (also when the client left: the backend generates it
    anyway, and it is billed), then write it with Kiln's usage and cost."""
    completion = _parse_completion(gen.send_and_read())
    gen.accepted = True  # a whole answer: billed, also if its client has left meanwhile
    gen.meter.observe_completion(completion)
    gen.mark_first_token()
    usage = gen.final_usage()
    apply_to_completion(completion, gen.chat.stop, gen.chat.single_tool_call)
    if not is_well_formed(completion.get("usage"), usage):
        completion["usage"] = _usage_object(usage)
    gen.head_sent = True
    yield Head(200, "application/json", {})
    return lambda charged_usd: dumps(completion, charged_usd)


def _parse_completion(raw):
    try:
        obj = json.loads(raw)
    except ValueError as err:
        raise UpstreamError("The model backend sent a reply that is not JSON.") from err
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        raise UpstreamError("The model backend sent a reply that is not a chat completion.")
    return obj


def _usage_object(usage):
    out = usage.to_openai()
    if usage.estimated:
        out["estimated"] = True
    return out


# -- stream ----------------------------------------------------------------------------------

def stream(gen):
    """Wait for the backend's status line up to one keepalive interval, then start the stream.

    An error known before the headers leave is a JSON error (or the plain-text 502 of README "API")
    with its own status; after that, a failure can only be told as an SSE error event. A
    backend's answer that is not an event stream is a failed try, retried on another backend
    (:meth:`gateway.flow.generation.Generation.open_response`).
    """
    config = gen.services.config
    call = gen.send()
    answered = call.wait(config.keepalive_s, gen.watch.gone)
    if answered:
        resp = gen.answer(call)
    gen.head_sent = True
    yield Head(200, EVENT_STREAM, STREAM_HEADERS)
    yield b""  # the headers leave now (the server writes them with the first body item)
    if not answered:
        yield from keepalives_until_answered(call, gen.watch.gone, config.keepalive_s)
        resp = gen.answer(call)
    gen.accepted = True
    rules = StreamRules(gen.meter, gen.chat.stop, gen.chat.single_tool_call)
    gen.pump = Pump(resp, gen.timeouts.idle_s)
    unfinished = yield from relay_stream(
        gen.pump, lambda payloads: _apply(gen, rules, payloads), gen.check_lease,
        config.keepalive_s, gen.timeouts.idle_s, config.max_event_bytes)
    check_complete(rules, unfinished)
    gen.read_whole = gen.pump.complete and not rules.cut
    gen.close()  # a cut generation: the backend stops now
    return lambda charged_usd: _end_of_stream(gen, rules, charged_usd)


def _apply(gen, rules, payloads):
    """Apply the stream rules to ``payloads``; return ``(bytes to send, stop relaying)``."""
    out = []
    for payload in payloads:
        framed = rules.apply(payload)
        if framed is not None:
            out.append(framed)
        if rules.cut or rules.error is not None:
            break
    if out and gen.meter.deltas:
        gen.mark_first_token()
    return b"".join(out), rules.cut or rules.error is not None


def _end_of_stream(gen, rules, charged_usd):
    """Return the last bytes of a complete stream: the end of choices Kiln cut at the budget,
    the usage chunk with the USD charged if the client asked for it, and ``[DONE]``."""
    tail = rules.length_frame() if rules.cut else b""
    if gen.chat.include_usage:
        usage = gen.final_usage()
        as_sent = is_well_formed(gen.meter.reported, usage)
        tail += rules.usage_frame(_usage_object(usage), charged_usd, as_sent)
    return tail + frame(DONE)
