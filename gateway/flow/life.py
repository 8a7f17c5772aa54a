"""One generation's life: admit, send it to a backend, relay the answer (JSON or an event
stream), settle; blind to the client's dialect, whose codec renders what the client reads.

The request flows one way (README, "Layout"): a view (:mod:`gateway.api`) parses the client's
body with its dialect's codec (:mod:`gateway.dialects`) into Kiln's canonical request and calls
:func:`respond`; this module admits it (:func:`gateway.flow.generation.admit`), then builds the
two sides of the generation: the money (:class:`~gateway.flow.generation.Generation`) and the
backend traffic (:class:`~gateway.backends.exchange.Exchange`), and runs one of the answer's
two paths (:mod:`gateway.flow.answers`). A generation is settled in exactly one place, the
``finally`` of :func:`_life`, with the outcome :func:`gateway.flow.outcomes.outcome_for` gives.
"""
from dataclasses import dataclass, field

from flask import Response

from ..background import Background
from ..backends.exchange import Exchange
from ..backends.fleet import Route
from ..backends.health import BackendStates
from ..backends.client import ClientGone, guard_writes
from ..backends.spans import spans_of
from ..backends.upstream import encode_body
from ..contract.tokenizers import LocalTokenizers
from ..contract.validation import EMBEDDINGS_ANSWER
from ..endings import CLIENT_CLOSED
from ..errors import GENERATION_HEADER, GatewayError
from . import answers
from .generation import Generation, admit
from .outcomes import outcome_for, stream_error
from .traces import ending_attributes, request_attributes


@dataclass(frozen=True)
class Services:
    """Per-app collaborators a generation needs after the request context is gone."""

    config: object
    engine: object
    session: object
    catalog: dict
    metrics: object
    ledger: object
    states: dict = field(default_factory=BackendStates)  # what this worker knows of each backend
    background: object = field(default_factory=Background)  # the worker's background greenlets
    live: set = field(default_factory=set)  # this worker's exchanges, until closed
    # The catalog's local tokenizers, built once per worker (gateway.contract.tokenizers).
    tokenizers: LocalTokenizers = field(default_factory=lambda: LocalTokenizers({}))


def respond(services, principal, request, codec, environ, on_answer=None):
    """Admit ``request`` and return the Flask response that relays its answer in ``codec``'s
    dialect.

    :param request: the canonical request (:class:`~gateway.contract.validation.ChatRequest`,
        or one of :mod:`gateway.contract.legacy`): its ``path``, ``body_for`` and ``kind``
        say where it goes, what each backend is sent and which answer comes back.
    :param codec: the client's dialect (:mod:`gateway.dialects`): renders the JSON body, the
        event stream and a failed stream's last event; its ``name`` is the usage event's
        ``endpoint``.
    :param environ: the WSGI environ (the client's socket, its address).
    :param on_answer: ``(generation id, outcome, last bytes, stream renderer or None) ->
        None``, called once the generation is settled and its last bytes are rendered, before
        they leave (a view keeps what its API stores, e.g. a stored response); not called when
        nobody is left to read them.
    :raises GatewayError: refused before any byte of the answer (402, 429, 502, 503, ...);
        an admitted generation is settled before this is raised.
    """
    spans = spans_of(environ)
    if spans.recording:
        spans.set(request_attributes(request, codec.name))
    route = Route(services, request.entry, request.routing_messages)
    route.take(services.config.backend_wait_s)  # 503 when none is free, before any charge
    sock = environ.get("gunicorn.socket")
    exchange = Exchange(services, route, request.entry.timeouts_for(services.config),
                        lambda backend: encode_body(request.body_for(backend)),
                        request.stream, sock, request.path, _reply_bound(services, request),
                        spans)
    try:
        if services.config.early_send and services.ledger.likely_admitted(principal.org_id):
            exchange.start()  # the backend begins while the ledger admits: "Early send"
        with spans.span("kiln.admission"):
            admission = admit(services, principal, request, codec.name)
    except BaseException:
        exchange.close()  # stops a backend sent early; gives the slot back
        raise
    gen = Generation(services, principal, request, admission, exchange,
                     environ.get("kiln.client_addr"))
    if request.stream:
        renderer = codec.stream_renderer(request)
        path = answers.stream(gen, exchange, request, renderer)
    elif request.kind == EMBEDDINGS_ANSWER:
        renderer, path = None, answers.embed(gen, exchange, request, codec)
    else:
        renderer, path = None, answers.complete(gen, exchange, request, codec)
    life = _life(gen, exchange, path, renderer, on_answer)
    headers = {GENERATION_HEADER: gen.gid, **request.response_headers}
    try:
        head = next(life)
    except GatewayError as err:
        err.headers.update(headers)
        raise
    except ClientGone:  # settled as cancelled; nobody is left to read an answer
        return Response(status=CLIENT_CLOSED, headers=headers)
    body = guard_writes(life, sock, exchange.timeouts.idle_s)
    return Response(body, status=head.status, content_type=head.content_type,
                    headers={**headers, **head.headers})


def _reply_bound(services, request):
    """The most bytes of a whole reply read for ``request``: its own bound (what a backend
    that keeps to the request can send), never above ``KILN_MAX_REPLY_BYTES``
    (docs/RELIABILITY.md, "Big answers")."""
    ceiling = services.config.max_reply_bytes
    own = getattr(request, "reply_bound", None)
    return ceiling if own is None else min(own, ceiling)


def _life(gen, exchange, path, renderer, on_answer=None):
    """Yield the response's head, then its body, from ``path`` (one of :mod:`.answers`);
    settle exactly once, whatever ends it.

    A completed path returns its last bytes (the JSON body; a stream's end) as a function of
    the USD charged, instead of sending them: they go out once the settlement is handed to the
    ledger, with the cost it debits (docs/METERING.md, "When the usage event is final"). A
    failed stream's last bytes are its error event, in the dialect of ``renderer``.
    """
    ending, last, head_sent, outcome = None, None, False, None
    try:
        head = next(path)
        head_sent = True
        yield head
        last = yield from path
    except BaseException as exc:  # noqa: BLE001 - the one place a generation ends
        ending = exc
        path.close()
        if isinstance(exc, GeneratorExit) or not head_sent:
            raise
        if not isinstance(exc, ClientGone):  # nobody left to tell
            event = renderer.error(stream_error(outcome_for(exc, stream_began=True), exc))
            last = lambda _charged: event  # noqa: E731
    finally:
        try:
            exchange.close()
        finally:
            outcome = outcome_for(ending, head_sent)
            _settle(gen, exchange.spans, outcome)
    if last is not None:
        tail = last(gen.charged_usd)
        if on_answer is not None:
            on_answer(gen.gid, outcome, tail, renderer)
        yield tail


def _settle(gen, spans, outcome):
    """Settle ``gen`` in its own span, then tell the request's span how it ended."""
    with spans.span("kiln.settlement"):
        gen.settle(outcome)
    if spans.recording:
        if gen.meter.cut:  # the choices Kiln ended at the budget: their last chunk is Kiln's
            spans.note_reply({"choices": [{"finish_reason": "length"}]})
        spans.set(ending_attributes(gen, outcome))
