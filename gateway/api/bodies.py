"""Reading a request's body, for every view that takes one: bounded in size (413), time and
memory (:mod:`gateway.api.intake`), a large one parsed and checked in the worker's child process
(:mod:`gateway.api.body_process`), and a connection whose body was left unread closed after the
answer (:func:`never_drained`, registered after each such blueprint's requests).
"""
from flask import current_app, g, request

from ..contract.json_body import parse_json_body
from ..errors import InvalidRequest, PayloadTooLarge
from . import intake

BODY_READ = "kiln.body_read"  # environ key: the whole body was read


def read_body(services, budget, dialect):
    """Read and parse the body, within the bounds of :mod:`gateway.api.intake`; return
    ``(body, size in bytes, canonical request or None)``. A large body is parsed and checked
    against ``dialect``'s contract (a codec's name) in one of the worker's child processes
    (:mod:`gateway.api.body_process`), which also gives the canonical request its codec
    built (so the view need not check the body again); a small one comes back with None."""
    config, length, org = services.config, request.content_length, g.principal.org_id
    if length is not None and length > config.max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {config.max_body_bytes} bytes.")
    if length is not None and length >= intake.INLINE_BYTES:
        held = budget.acquire(org, length)  # before the first byte is read
        try:
            parts, size = _receive(config, length)
            return _parse(services, budget, parts, size, dialect)
        finally:
            budget.release(org, held)
    parts, size = _receive(config, length)
    if size < intake.INLINE_BYTES:
        return _parse(services, budget, parts, size, dialect)
    held = budget.acquire(org, size)  # a large body of unknown length: held by its real size
    try:
        return _parse(services, budget, parts, size, dialect)
    finally:
        budget.release(org, held)


def never_drained(response):
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


def _parse(services, budget, parts, size, dialect):
    """Parse a small body inline; a large one in one of the worker's child processes, which
    checks it against the whole contract first (:mod:`gateway.api.body_process`): its parts go
    down the pipe as they were read, never joined in the worker. Return ``(body, size,
    canonical request or None)``."""
    if size < intake.INLINE_BYTES or size > services.config.max_body_bytes:
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        return parse_json_body(raw, request.content_type,
                               services.config.max_body_bytes), size, None
    checkers = current_app.extensions["kiln.body_process"]
    body, checked = budget.run(g.principal.org_id, checkers.parse, parts,
                               request.content_type or "", dialect, services.catalog,
                               start=checkers.start, cost_s=checkers.cpu_s)
    return body, size, checked
