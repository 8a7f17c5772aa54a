"""Opt-in CORS, for browser apps that call Kiln with a user's key (``KILN_CORS_ORIGINS``).

Off unless origins are configured. Then, on the API paths (``/v1/...`` and ``/openapi.json``):

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here, 204, before authentication, validation or admission: it needs no key and costs nothing;
- every response, errors and streams included, names an allowed origin in
  ``Access-Control-Allow-Origin``, so that a browser app can read a 401, 402, 429 or 502 too.

No credentials mode: the key travels in ``Authorization``, which needs no cookies, and the
Fetch standard never lets ``*`` stand for ``Authorization`` in ``Access-Control-Allow-Headers``,
so the request headers are listed by name (those the OpenAI SDKs send). Probes and ``/metrics``
stay same-origin.
"""
from dataclasses import dataclass
from urllib.parse import urlsplit

from flask import Response, current_app, request

from ..errors import GENERATION_HEADER

ALLOW_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"  # DELETE: a stored response, a key
# Request headers the OpenAI and Anthropic SDKs (Python, JavaScript) send besides the
# CORS-safelisted ones; Anthropic's JavaScript SDK asks browsers for the last one.
ALLOW_HEADERS = frozenset({"authorization", "content-type", "accept", "user-agent",
                           "openai-organization", "openai-project", "openai-beta",
                           "idempotency-key", "x-api-key", "anthropic-version",
                           "anthropic-beta", "anthropic-dangerous-direct-browser-access"})
ALLOW_HEADER_PREFIX = "x-stainless-"  # x-stainless-os, -retry-count, -timeout, ... (SDK metadata)
# The Messages API's lowered max_tokens (gateway/dialects/messages_request.py).
EXPOSE_HEADERS = f"{GENERATION_HEADER}, Retry-After, X-Kiln-Max-Tokens-Lowered"
MAX_AGE_S = 600  # browsers cache a preflight this long (Chromium caps it at 7200)
API_PATHS = ("/v1/", "/openapi.json")
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class CorsPolicy:
    """Which origins may read Kiln's answers: ``any_origin`` (``*``) or those in ``origins``."""

    origins: frozenset
    any_origin: bool = False

    def allows(self, origin):
        """Tell whether a browser page from ``origin`` may read the answer."""
        return bool(origin) and (self.any_origin or origin.lower() in self.origins)

    def allowed_headers(self, requested):
        """Return the names in ``requested`` (an ``Access-Control-Request-Headers`` value)
        that a request may carry, lowercase, in their order."""
        names = (n.strip().lower() for n in (requested or "").split(","))
        return [n for n in names if n in ALLOW_HEADERS or n.startswith(ALLOW_HEADER_PREFIX)]


def parse_origins(setting):
    """Return the :class:`CorsPolicy` for a ``KILN_CORS_ORIGINS`` value, or None when empty.

    :param setting: comma-separated origins (``https://app.example.com``,
        ``http://localhost:5173``), or ``*`` for any origin.
    :raises ValueError: an entry is not ``scheme://host[:port]`` with scheme http or https, or
        ``*`` is mixed with origins.
    """
    entries = [e.strip() for e in (setting or "").split(",") if e.strip()]
    if not entries:
        return None
    if "*" in entries:
        if len(entries) > 1:
            raise ValueError("KILN_CORS_ORIGINS: '*' (any origin) cannot be mixed with origins")
        return CorsPolicy(frozenset(), any_origin=True)
    return CorsPolicy(frozenset(_origin(e) for e in entries))


def _origin(entry):
    """Return ``entry`` serialized as browsers send ``Origin``: lowercase, no default port."""
    try:
        parts = urlsplit(entry.rstrip("/"))
        port = parts.port
    except ValueError as err:
        raise ValueError(f"KILN_CORS_ORIGINS: {entry!r} is not an origin") from err
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.path or parts.query \
            or parts.fragment or parts.username or parts.password:
        raise ValueError(f"KILN_CORS_ORIGINS: {entry!r} is not an origin "
                         f"(scheme://host[:port], scheme http or https)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{scheme}://{host}" + (f":{port}" if port not in (None, DEFAULT_PORTS[scheme]) else "")


def init_app(app, setting):
    """Switch CORS on for ``app`` when ``setting`` names origins; otherwise change nothing.

    :raises ValueError: ``setting`` is malformed (see :func:`parse_origins`).
    """
    policy = parse_origins(setting)
    if policy is None:
        return
    app.extensions["kiln.cors"] = policy
    app.before_request(_answer_preflight)
    app.after_request(_allow_origin)


def _answer_preflight():
    """Answer a CORS preflight on an API path, with no key, no admission, no charge."""
    if not (request.method == "OPTIONS" and request.path.startswith(API_PATHS)
            and "Access-Control-Request-Method" in request.headers
            and "Origin" in request.headers):
        return None
    policy = current_app.extensions["kiln.cors"]
    response = Response(status=204)
    del response.headers["Content-Type"]  # no body
    response.vary.update(("Origin", "Access-Control-Request-Headers"))
    if policy.allows(request.headers["Origin"]):
        headers = policy.allowed_headers(request.headers.get("Access-Control-Request-Headers"))
        response.headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
        if headers:
            response.headers["Access-Control-Allow-Headers"] = ", ".join(headers)
        response.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
    return response


def _allow_origin(response):
    """Name the caller's origin on every API response when it is allowed (errors included)."""
    if not request.path.startswith(API_PATHS):
        return response
    policy = current_app.extensions["kiln.cors"]
    origin = request.headers.get("Origin")
    if not policy.any_origin:
        response.vary.add("Origin")  # the answer differs by origin: caches must keep them apart
    if policy.allows(origin):
        response.headers["Access-Control-Allow-Origin"] = "*" if policy.any_origin else origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
    return response
