"""``POST /v1/chat/completions``, the view: read the body, parse it with the chat codec, hand it
to the flow.

README "API" and docs/PARAMETERS.md are the contract; README gives the order: auth, validation
(:mod:`gateway.dialects.chat`), maintenance, admission, backend, relay, settlement (the last
four in :mod:`gateway.flow.life`).
Reading and parsing the body are bounded in time and memory (:mod:`gateway.api.intake`).
"""
from flask import Blueprint, current_app, g, request

from ..contract.json_body import parse_json_body
from ..dialects.chat import CODEC
from ..errors import Forbidden, InvalidRequest, PayloadTooLarge
from ..flow.life import respond
from ..ops import lifecycle
from . import intake
from .auth import require_key

bp = Blueprint("chat", __name__)
BODY_READ = "kiln.body_read"  # environ key: the whole body was read


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    services = current_app.extensions["kiln"]
    body, body_bytes = _read_body(services, current_app.extensions["kiln.parse_budget"])
    chat = CODEC.parse(body, services.catalog, body_bytes)
    if not g.principal.may_use(chat.entry.id):
        raise Forbidden(f"This API key may not use model '{chat.entry.id}'.", param="model",
                        code="model_not_allowed")
    lifecycle.check_maintenance()
    return respond(services, g.principal, chat, CODEC, request.environ)


def _read_body(services, budget):
    """Read and parse the body, within the bounds of :mod:`gateway.api.intake`; return
    ``(body, size in bytes)``."""
    config, length = services.config, request.content_length
    if length is not None and length > config.max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {config.max_body_bytes} bytes.")
    if length is not None and length >= intake.INLINE_BYTES:
        held = budget.acquire(length)  # before the first byte is read
        try:
            parts, size = _receive(config, length)
            return _parse(services, budget, parts, size), size
        finally:
            budget.release(held)
    parts, size = _receive(config, length)
    if size < intake.INLINE_BYTES:
        return _parse(services, budget, parts, size), size
    held = budget.acquire(size)  # a large body of unknown length: held by its real size
    try:
        return _parse(services, budget, parts, size), size
    finally:
        budget.release(held)


@bp.after_request
def _never_drained(response):
    """Close the connection after answering a request whose body was left unread (refused
    before it was read: a bad key, too large, no share of the parse budget, too slow), unless
    it is small. Else gunicorn would read and discard the rest to keep the connection, 1 KiB
    at a time and without giving the event loop a turn: up to 16 MiB, the worker's other
    requests waiting meanwhile."""
    length = request.content_length
    if length is None and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
        length = 0  # no body at all
    if request.environ.get(BODY_READ) or length is not None and length < intake.DRAIN_BYTES:
        return response
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        response.call_on_close(lambda: intake.hang_up(sock))
    return response


def _receive(config, length):
    """Return the body as ``(parts, size in bytes)`` (:func:`gateway.api.intake.read_body`)."""
    parts = intake.read_body(request.stream, length, config.max_body_bytes,
                             config.body_timeout_s)
    size = sum(map(len, parts))
    request.environ[BODY_READ] = length is None and size <= config.max_body_bytes or (
        length is not None and size == length)
    if length is not None and size < length:
        # The client went away mid-body: whatever parses from the part received was not sent.
        raise InvalidRequest(f"Request body ended after {size} of the {length} bytes "
                             f"announced by Content-Length.", code="incomplete_body")
    return parts, size


def _parse(services, budget, parts, size):
    """Parse a small body inline; a large one in the worker's child process, which checks it
    against the whole contract first (:mod:`gateway.api.body_process`): its parts go down the
    pipe as they were read, never joined in the worker."""
    if size < intake.INLINE_BYTES or size > services.config.max_body_bytes:
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        return parse_json_body(raw, request.content_type, services.config.max_body_bytes)
    checker = current_app.extensions["kiln.body_process"]
    checker.start()
    return budget.run(checker.check, parts, request.content_type or "")
