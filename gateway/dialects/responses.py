"""The Responses API (``POST /v1/responses``) as a codec on the flow's seam: a Responses body
in, Kiln's canonical chat request out; the flow's result out as a Response object, its typed
event stream, and errors in OpenAI's envelope (docs/RESPONSES.md).

The translation itself is in :mod:`.responses_request` (the body) and
:mod:`.responses_stream` (the answer); this module is the interface the flow calls.
"""
from . import responses_request, responses_stream
from .responses_request import ResponsesRequest
from .responses_stream import ResponsesStream

__all__ = ["ResponsesCodec", "ResponsesRequest", "ResponsesStream"]


class ResponsesCodec:
    """The Responses dialect.

    :param store_default: what a request without ``store`` means (OpenAI's default: true;
        a setting may turn it off, issue "Stored responses").
    """

    name = "responses"  # the usage event's endpoint

    def __init__(self, store_default=True):
        self.store_default = store_default

    def parse(self, body, catalog, body_bytes, history=None):
        """Return the :class:`ResponsesRequest` (a ``ChatRequest``) for a Responses ``body``.

        :param history: the input and output items of the ``previous_response_id`` chain,
            oldest first, prepended to ``input`` (and counted in the hold's prompt bound).
        :raises InvalidRequest: 400 with OpenAI's ``param`` (``input[0].content[1].image_url``).
        :raises ModelNotFound: 404.
        """
        return responses_request.parse(body, catalog, body_bytes, history,
                                       store_default=self.store_default)

    def error_body(self, err):
        """Return ``(HTTP status, body)``: OpenAI's error envelope, as for chat."""
        return err.status, err.envelope()

    def render_json(self, completion, usage, charged_usd, request, stops_hit=None):
        """Return the Response object (bytes) of a whole chat ``completion``.

        :param usage: :class:`gateway.billing.Usage`, the billed counts.
        :param charged_usd: Decimal, written exactly as ``usage.cost``.
        """
        return responses_stream.render_json(completion, usage, charged_usd, request)

    def stream_renderer(self, request):
        """Return a :class:`ResponsesStream` for one streamed ``request``."""
        return ResponsesStream(request)
