"""The embeddings dialect (``POST /v1/embeddings``, OpenAI's API reference:
https://platform.openai.com/docs/api-reference/embeddings): inputs in, a list of embeddings
out, JSON only.

The answer is Kiln's own object: ``{"object": "list", "data": [{"object": "embedding",
"index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens", "cost"}}`` with the
vectors in the input's order, as floats or as base64 (little-endian float32, as OpenAI
encodes them) whatever the backend sent.
"""
import base64
import struct

from ..backends.sse import dumps
from ..contract.legacy import validate_embeddings


class EmbeddingsCodec:
    """Embeddings in and out: the contract's checks, OpenAI's shapes and error envelope."""

    name = "embeddings"

    def parse(self, body, catalog, body_bytes):
        """Return the canonical request (:class:`~gateway.contract.legacy.EmbeddingsRequest`).

        :raises GatewayError: 400, 404 as :func:`~gateway.contract.legacy.validate_embeddings`.
        """
        return validate_embeddings(body, catalog, body_bytes)

    def error_body(self, err):
        """Return ``(HTTP status, JSON object)`` of a refusal in the OpenAI envelope."""
        return err.status, err.envelope()

    def render_json(self, vectors, usage, charged_usd, request, stops_hit=None):
        """Return the JSON body: ``vectors`` (one per input, in order) in the encoding asked
        for, the billed usage (``estimated`` when Kiln counted) and ``usage.cost``."""
        encode = _to_base64 if request.encoding_format == "base64" else _to_floats
        out = {"object": "list",
               "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                        for i, v in enumerate(vectors)],
               "model": request.entry.id,
               "usage": {"prompt_tokens": usage.prompt, "total_tokens": usage.prompt}}
        if usage.estimated:
            out["usage"]["estimated"] = True
        return dumps(out, charged_usd)

    def stream_renderer(self, request):  # pragma: no cover - the contract refuses a stream
        raise NotImplementedError("embeddings are never streamed")


def _to_base64(vector):
    if isinstance(vector, str):
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _to_floats(vector):
    if not isinstance(vector, str):
        return vector
    raw = base64.b64decode(vector)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw[:len(raw) - len(raw) % 4]))
