"""How a generation ends: one table from what ended it to the usage event's status, the HTTP
status the client got, and the error code.

The flow (:mod:`gateway.flow.life`) asks :func:`outcome_for` once, in its one ``finally``;
nothing else decides a status.
"""
import logging
from dataclasses import dataclass

from ..endings import (CLIENT_CLOSED, IDLE_TIMEOUT, INTERNAL_ERROR, LEASE_EXPIRED, SHUTTING_DOWN,
                       UPSTREAM_ERROR, UPSTREAM_REJECTED, UPSTREAM_TOO_LARGE, Status)
from ..errors import (GatewayError, InternalError, ServiceUnavailable, ShuttingDown,
                      UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamTooLarge)
from ..backends.client import ClientGone
from ..backends.relay import StreamFailed
from ..backends.sse import DONE, unfinished_payload

log = logging.getLogger("kiln.requests")


class LeaseLost(Exception):
    """The generation's in-flight lease was swept (its settlement is done): stop relaying."""


@dataclass(frozen=True)
class Outcome:
    """How one generation ended."""

    status: Status
    http_status: int      # what the client got (200 for a stream that began, 499 gone)
    code: str = None      # the error envelope's ``code``
    message: str = None   # the error message (kept on the usage event, not in logs)


# What ended the generation -> (status, HTTP status before the stream began, code). Checked in
# order: the first class that matches wins. A failure after a stream began is told to the client
# as an SSE error event in a 200 response.
TABLE = (
    (ClientGone, Status.CLIENT_CANCELLED, CLIENT_CLOSED, None),
    (GeneratorExit, Status.CLIENT_CANCELLED, CLIENT_CLOSED, None),
    (LeaseLost, Status.ABANDONED, 500, LEASE_EXPIRED),
    # The operator's stop (shutdown, reload past its graceful timeout): not the customer's error.
    (ShuttingDown, Status.INTERRUPTED, 503, SHUTTING_DOWN),
    (UpstreamTimeout, Status.TIMEOUT, 502, None),  # its code names the timeout that fired
    (UpstreamRejected, Status.REJECTED, 400, UPSTREAM_REJECTED),
    (ServiceUnavailable, Status.UPSTREAM_ERROR, 503, None),
    # A whole reply over its bound: the backend answered and generated (billed), Kiln could
    # not relay it (docs/RELIABILITY.md, "Big answers").
    (UpstreamTooLarge, Status.UPSTREAM_ERROR, 502, UPSTREAM_TOO_LARGE),
    (UpstreamError, Status.UPSTREAM_ERROR, 502, UPSTREAM_ERROR),
    (GatewayError, Status.ERROR, None, None),
    (BaseException, Status.ERROR, 500, INTERNAL_ERROR),
)
STREAM_FAILURES = {"timeout": (Status.TIMEOUT, IDLE_TIMEOUT),
                   "too_large": (Status.UPSTREAM_ERROR, UPSTREAM_TOO_LARGE),
                   "upstream_error": (Status.UPSTREAM_ERROR, UPSTREAM_ERROR)}
COMPLETED = Outcome(Status.COMPLETED, 200)


def outcome_for(exc, stream_began=False):
    """Return the :class:`Outcome` of a generation ended by ``exc`` (None: it completed).

    :param stream_began: the stream's headers went out, so the client saw a 200.
    """
    if exc is None:
        return COMPLETED
    if isinstance(exc, StreamFailed):
        status, code = STREAM_FAILURES[exc.kind]
        return Outcome(status, 200, code, str(exc))
    status, http_status, code = next(row[1:] for row in TABLE if isinstance(exc, row[0]))
    if isinstance(exc, GatewayError):
        http_status, code = http_status or exc.status, code or exc.code
        message = exc.message
    else:
        message = None if status is Status.CLIENT_CANCELLED else _internal(exc)
    if stream_began and status is not Status.CLIENT_CANCELLED:
        http_status = 200
    return Outcome(status, http_status, code, message)


def _internal(exc):
    return "lease expired: the generation was closed by the sweeper" \
        if isinstance(exc, LeaseLost) else f"internal error ({type(exc).__name__})"


def check_complete(rules, unfinished):
    """Raise :class:`StreamFailed` unless the backend's stream ended as a complete one: its
    ``[DONE]`` (also as its last event, without the blank line after it, however it is
    written), a finish reason, or Kiln's cut at the budget."""
    if rules.error is not None:
        message = rules.error.get("message") if isinstance(rules.error, dict) else None
        raise StreamFailed(f"The model backend failed mid-stream: {message}" if message
                           else "The model backend failed mid-stream.")
    if rules.cut or rules.done or rules.finished or (
            unfinished and unfinished_payload(unfinished) == DONE):
        return
    raise StreamFailed("The model backend ended the stream before it was complete.")


def stream_error(outcome, exc):
    """Return the error that ends a failed stream, for its codec to render as the dialect's last
    event (never a stream that looks complete).

    Kiln's own decision to end it (a :class:`GatewayError` such as ``ShuttingDown``) is told in
    its own words; a failure of Kiln's is logged and told as one; the rest are the backend's.
    """
    if outcome.status is Status.ERROR and isinstance(exc, GatewayError):
        error = exc
    elif outcome.status is Status.ERROR:
        log.error("stream relay failed", exc_info=exc)
        error = InternalError("The gateway failed while relaying the stream.")
    else:
        error = UpstreamError(outcome.message or "The model backend failed mid-stream.")
    error.code = outcome.code  # the outcome's, even none: the table decided it
    return error
