"""Gateway errors and their rendering in the OpenAI error envelope.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` (README, "API"), except
upstream failures (502), whose body is plain text (README, "API": a backend's error answer).
"""
import json
import logging

from flask import Response, g
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)

# The id of the request's usage event, on every response of an admitted request (README).
GENERATION_HEADER = "X-Neocloud-Generation-Id"


class GatewayError(Exception):
    """Base error: an HTTP status plus the envelope fields."""

    status = 500
    type = "server_error"
    code = None

    def __init__(self, message, *, param=None, code=None, headers=None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def envelope(self):
        """Return the OpenAI error envelope as a dict."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def to_response(self):
        """Render as a Flask response (JSON envelope)."""
        return json_error(self.status, self.envelope(), self.headers)


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class UnknownParameter(InvalidRequest):
    """A field the API does not have (400 ``unknown_parameter``), as OpenAI refuses one."""

    code = "unknown_parameter"

    def __init__(self, param, message=None):
        super().__init__(message or f"Unknown parameter: '{param}'.", param=param)


def refuse_unknown_keys(obj, allowed, where):
    """Refuse the first key of the object ``obj`` (at ``where``) that is not in ``allowed``.

    :raises UnknownParameter: ``param`` = ``where.key`` (the key cut to 100 characters).
    """
    for key in obj:
        if key not in allowed:
            raise UnknownParameter(f"{where}.{key[:100]}")


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class InsufficientCredits(GatewayError):
    status = 402
    type = "insufficient_quota"
    code = "insufficient_credits"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class UpstreamError(GatewayError):
    """The backend failed or was unreachable: 502 with a plain-text body (README, "API")."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"

    def to_response(self):
        return Response(self.message + "\n", status=self.status, mimetype="text/plain",
                        headers=self.headers)


class UpstreamTimeout(UpstreamError):
    """The backend did not answer within the connect or read timeout (502)."""

    code = "upstream_timeout"


class UpstreamTooLarge(UpstreamError):
    """The backend answered 2xx with a reply larger than Kiln's bound for the request
    (docs/RELIABILITY.md, "Big answers"): 502 ``upstream_too_large`` in the error envelope.

    Not a failed try: the backend answered and generated, so it is neither retried nor counted
    against the backend's health, and what it generated is billed (docs/METERING.md).

    :param bytes_read: the reply's bytes read before Kiln stopped (more than the bound).
    """

    code = "upstream_too_large"

    def __init__(self, message, *, bytes_read, **kwargs):
        super().__init__(message, **kwargs)
        self.bytes_read = bytes_read

    def to_response(self):
        return GatewayError.to_response(self)  # a clear error, in the envelope


class UpstreamRejected(InvalidRequest):
    """The model server answered 4xx; passed on as 400 in the envelope with its message."""

    code = "upstream_rejected"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class ShuttingDown(ServiceUnavailable):
    """The worker is stopping (graceful stop or reload) and its deadline is near: generations
    still running are ended, told and settled, rather than killed unsettled."""

    code = "server_shutting_down"

    def __init__(self):
        super().__init__("The gateway is restarting and ended this generation early; what was "
                         "generated is billed. Retry the request.")


class DatabaseBusy(ServiceUnavailable):
    """Every pooled database connection is busy: told at once, never a 500 after a long wait."""

    code = "database_busy"

    def __init__(self):
        super().__init__("Kiln's database connections are all busy; retry with backoff.",
                         headers={"Retry-After": "1"})


class DatabaseUnavailable(ServiceUnavailable):
    """The database is unreachable or failing over: nothing was admitted or charged."""

    code = "database_unavailable"

    def __init__(self):
        super().__init__("Kiln cannot reach its database; retry with backoff.",
                         headers={"Retry-After": "5"})


class InternalError(GatewayError):
    """Kiln itself failed: internals stay in the log, the client gets the envelope (500)."""

    code = "internal_error"

    def __init__(self, message="Internal error.", *, code=None):
        super().__init__(message, code=code)


class HTTPError(GatewayError):
    """An error Flask or werkzeug raised (404 route, 405 method, ...), in the envelope; its
    ``code`` is the status's name (``not_found``, ``method_not_allowed``)."""

    def __init__(self, err):
        super().__init__(err.description,
                         code=(err.name or "error").lower().replace(" ", "_"))
        self.status = err.code
        self.type = "invalid_request_error" if err.code < 500 else "server_error"


class ProtocolError(GatewayError):
    """A request the HTTP server refused before the app saw it (a bad request line, header or
    chunk size; a header too large): the server's status and message, in the envelope, as nginx
    answers the same faults in front of it (deploy/nginx/kiln.conf)."""

    CODES = {400: "bad_request", 403: "forbidden", 414: "uri_too_long",
             417: "expectation_failed", 431: "request_header_too_large",
             501: "not_implemented"}

    def __init__(self, status, message):
        super().__init__(message or "Internal error.",
                         code=self.CODES.get(status, "internal_error" if status >= 500
                                             else "bad_request"))
        self.status = status
        self.type = ("permission_error" if status == 403 else
                     "invalid_request_error" if status < 500 else "server_error")

    def http_bytes(self, reason):
        """The whole HTTP/1.1 response (``Connection: close``) as bytes."""
        body = json.dumps(self.envelope()).encode()
        return (f"HTTP/1.1 {self.status} {reason}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode("latin-1") + body


def json_error(status, envelope, headers=None):
    """Return a JSON response with ``envelope`` and ``status``."""
    return Response(json.dumps(envelope), status=status, mimetype="application/json",
                    headers=headers)


def register_error_handlers(target, render=None):
    """Render every error raised in a view in an error envelope, never an HTML page.

    :param target: the app (every view) or a blueprint (its views: a dialect's own envelope).
    :param render: ``GatewayError -> (HTTP status, JSON object)``, a dialect codec's
        ``error_body``; None: the OpenAI envelope (and a backend failure's plain-text 502).
    """

    def _respond(err):
        g.kiln_error_code = err.code  # for the error metrics: a 502 body is plain text
        if render is None:
            return err.to_response()
        status, body = render(err)
        return json_error(status, body, err.headers)

    @target.errorhandler(GatewayError)
    def _gateway_error(err):
        return _respond(err)

    @target.errorhandler(HTTPException)
    def _http_error(err):
        return _respond(HTTPError(err))

    @target.errorhandler(sa_exc.TimeoutError)
    def _database_busy(err):
        return _respond(DatabaseBusy())

    @target.errorhandler(sa_exc.OperationalError)
    def _database_down(err):
        log.error("database unavailable: %s", err.orig or err)
        return _respond(DatabaseUnavailable())

    @target.errorhandler(Exception)
    def _unexpected(err):
        # The one catch-all: internals stay in the log, the client gets the envelope.
        log.exception("unhandled error")
        return _respond(InternalError())
