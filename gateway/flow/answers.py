"""The two ways a generation's answer reaches its client: one JSON body, or an event stream.

Each path is a generator driven by :func:`gateway.flow.life.respond`: it yields the response's
:class:`Head`, then body bytes, and returns its last bytes as a function of the USD charged,
which the flow sends after the settlement (docs/METERING.md). Kiln's rules (the budget, stop
strings, one tool call) are applied here to the backend's chat completion or chunks
(:mod:`gateway.flow.rules`); the client's dialect is the codec's, which renders the result.
Nothing here touches the ledger.
"""
import base64
import binascii
from dataclasses import dataclass

import gevent

from ..backends.relay import StreamFailed, relay_stream
from ..backends.sse import loads
from ..errors import UpstreamError
from .outcomes import check_complete
from .rules import StreamRules, apply_to_completion, indexes_are_integers

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A whole reply at least this large gives the worker's event loop a turn between the steps
# that hold it (parsing, metering, writing): a real turn, a timer, so that other greenlets'
# sockets are polled too (docs/RELIABILITY.md, "Big answers").
LARGE_REPLY_BYTES = 1024 * 1024
TURN_S = 0.0005


@dataclass(frozen=True)
class Head:
    """The status line and headers of a generation's response."""

    status: int
    content_type: str
    headers: dict


# -- JSON ------------------------------------------------------------------------------------

def complete(gen, exchange, request, codec):
    """Read the backend's whole reply (also when the client left: the backend generates it
    anyway, and it is billed), then write it in the codec's dialect with Kiln's usage and
    cost."""
    completion = exchange.send_and_read(_parse_completion)
    large = exchange.reply_bytes >= LARGE_REPLY_BYTES
    _turn(large)
    gen.meter.observe_completion(completion)
    gen.mark_first_token()
    usage = gen.final_usage()
    stops_hit = apply_to_completion(completion, request.stop, request.single_tool_call,
                                    getattr(request, "echoed", None))
    exchange.spans.note_reply(completion)
    _turn(large)
    yield Head(200, "application/json", {})
    return lambda charged_usd: codec.render_json(completion, usage, charged_usd, request,
                                                 stops_hit)


def _turn(large):
    """Let the worker's other greenlets run after a step over a large reply."""
    if large:
        gevent.sleep(TURN_S)


def _parse_completion(raw):
    try:
        obj = loads(raw)
    except ValueError as err:
        raise UpstreamError("The model backend sent a reply that is not JSON.") from err
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        raise UpstreamError("The model backend sent a reply that is not a chat completion.")
    if not indexes_are_integers(obj["choices"]):
        raise UpstreamError("The model backend sent a choice whose index is not an integer.")
    return obj


# -- embeddings ------------------------------------------------------------------------------

def embed(gen, exchange, request, codec):
    """Read the backend's whole list of embeddings, one vector per input, and write it in the
    codec's dialect with Kiln's usage and cost. A reply with fewer (or more) vectors than
    inputs is the backend's failure: 502, and nothing is billed."""
    expected = len(request.inputs)
    reply = exchange.send_and_read(lambda raw: _parse_embeddings(raw, expected))
    vectors, reported = reply
    gen.meter.reported = reported
    gen.mark_first_token()
    usage = gen.final_usage()
    yield Head(200, "application/json", {})
    return lambda charged_usd: codec.render_json(vectors, usage, charged_usd, request)


def _parse_embeddings(raw, expected):
    """Return ``(vectors in input order, the reply's usage)`` of an embeddings reply.

    A vector is a list of numbers or a base64 string; a list of per-token vectors (a server
    whose model has no pooling of its own: llama-cpp-python with a chat model) is mean-pooled
    into one (docs/PARAMETERS.md, "Embeddings").

    :raises UpstreamError: not a list of ``expected`` embeddings, indexed 0 to expected - 1.
    """
    try:
        obj = loads(raw)
    except ValueError as err:
        raise UpstreamError("The model backend sent a reply that is not JSON.") from err
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        raise UpstreamError("The model backend sent a reply that is not a list of embeddings.")
    if len(data) != expected:
        raise UpstreamError(f"The model backend returned {len(data)} embeddings for "
                            f"{expected} inputs.")
    vectors = [None] * expected
    for position, item in enumerate(data):
        index = item.get("index", position) if isinstance(item, dict) else None
        vector = _vector(item.get("embedding")) if isinstance(item, dict) else None
        if vector is None or type(index) is not int or not 0 <= index < expected \
                or vectors[index] is not None:
            raise UpstreamError("The model backend sent an embedding that is not one.")
        vectors[index] = vector
    return vectors, obj.get("usage")


def _vector(value):
    """A vector as sent, a mean-pooled list of per-token vectors, or None."""
    if isinstance(value, str):  # base64 little-endian float32, as asked
        try:
            size = len(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError):
            return None
        return value if size and size % 4 == 0 else None
    if not isinstance(value, list) or not value:
        return None
    if all(type(x) in (float, int) for x in value):
        return value
    if all(isinstance(v, list) and v and len(v) == len(value[0])
           and all(type(x) in (float, int) for x in v) for v in value):
        return [sum(column) / len(value) for column in zip(*value, strict=True)]
    return None


# -- stream ----------------------------------------------------------------------------------

def stream(gen, exchange, request, renderer):
    """Wait for the backend's status line up to one keepalive interval, then start the stream.

    An error known before the headers leave is a JSON error (or the plain-text 502 of README
    "API") with its own status; after that, a failure can only be told as the dialect's error
    event. A backend's answer that is not an event stream is a failed try, retried on another
    backend (:class:`gateway.backends.exchange.Exchange`).
    """
    config = gen.services.config
    exchange.send()
    answered = exchange.wait(config.keepalive_s)
    if answered:
        exchange.answer()
    yield Head(200, renderer.content_type, STREAM_HEADERS)
    # The headers leave now (the server writes them with the first body item), with what the
    # dialect sends at once (Anthropic's message_start, the Responses API's response.created).
    yield renderer.head()
    if not answered:
        yield from exchange.keepalives(config.keepalive_s, renderer.keepalive)
        exchange.answer()
    pump = exchange.take()
    rules = StreamRules(gen.meter, request.stop, request.single_tool_call,
                        getattr(request, "echoed", None))
    with exchange.spans.span("kiln.stream"):  # the first token is an event of it
        try:
            try:
                unfinished = yield from relay_stream(
                    pump, lambda payloads: _apply(gen, rules, renderer, payloads),
                    gen.check_lease, config.keepalive_s, exchange.timeouts.idle_s,
                    config.max_event_bytes, renderer.keepalive)
            except StreamFailed as err:
                if not (rules.done and err.kind in ("upstream_error", "timeout")):
                    raise
                # The backend said [DONE], then broke the connection or went silent before
                # its body's end (a chunked body's last chunk): the stream it sent is whole.
                unfinished = b""
            check_complete(rules, unfinished)
        except StreamFailed as err:
            rules.failed(err.kind)
            raise
    exchange.finish(keep_connection=pump.complete and not rules.cut)  # a cut one stops now
    return lambda charged_usd: renderer.end(gen.final_usage(), charged_usd, rules)


def _apply(gen, rules, renderer, payloads):
    """Apply the stream rules to ``payloads`` and render what passes; return ``(bytes to send,
    stop relaying)``."""
    out = []
    for payload in payloads:
        kept = rules.apply(payload)
        if kept is not None:
            out.append(renderer.chunk(*kept))
            gen.exchange.spans.note_reply(kept[1])
        if rules.cut or rules.error is not None:
            break
    if out and gen.meter.deltas:
        gen.mark_first_token()
    return b"".join(out), rules.cut or rules.error is not None
