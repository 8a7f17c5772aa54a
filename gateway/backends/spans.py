"""The spans of one request, as the flow and the backend traffic call them: a handle handed
down from the request (``environ[ENVIRON_KEY]``), made by :mod:`gateway.ops.tracing` with
OpenTelemetry when tracing is on (docs/TRACES.md); :data:`NO_SPANS` when it is off, whose every
method does nothing and imports nothing.

It lives here, not in ``ops``, because the layers that call it (``flow``, ``backends``) may
import only ``backends`` and the shared modules (README, "Layout"). The handle's methods:

* ``recording``: whether anything is recorded (the caller may skip building attributes);
* ``span(name, attributes=None)``: a context manager, an internal span under the request's
  (admission, the stream, the settlement); an exception leaving it marks it failed;
* ``backend_try(backend)``: a client span under the request's for one try of ``backend``
  (:class:`gateway.contract.catalog.Backend`), returned as an object with ``headers()`` (the
  W3C ``traceparent`` to send the backend, a dict) and ``end(error=None, status=None)``;
* ``event(name)``: an event on the innermost open span (the first token, on the stream's);
* ``note_reply(obj)``: a reply or stream chunk (dict) the client is sent, for the response's
  id, model and finish reasons (never its content);
* ``set(attributes)``: attributes of the request's span (str, bool, int, float, or lists).
"""
ENVIRON_KEY = "kiln.spans"


class _NoTry:
    """A backend try that is not traced."""

    __slots__ = ()

    def headers(self):
        return None

    def end(self, error=None, status=None):
        pass


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class NoSpans:
    """Tracing off: every call returns at once."""

    __slots__ = ()
    recording = False

    def span(self, name, attributes=None):
        return _NO_SPAN

    def backend_try(self, backend):
        return _NO_TRY

    def event(self, name):
        pass

    def note_reply(self, obj):
        pass

    def set(self, attributes):
        pass


_NO_SPAN, _NO_TRY = _NoSpan(), _NoTry()
NO_SPANS = NoSpans()


def spans_of(environ):
    """The request's span handle in the WSGI ``environ``: :data:`NO_SPANS` when not traced."""
    return environ.get(ENVIRON_KEY, NO_SPANS)
