"""One codec per public API: the client's body in, Kiln's canonical request out; the flow's
result in, the dialect's JSON body, event stream and error envelope out.

May import ``flow``, ``contract``, ``backends`` (SSE framing) and the shared modules; never
``api``, ``ledger`` or ``ops``.
"""
from .chat import CODEC as CHAT
from .completions import CompletionsCodec
from .embeddings import EmbeddingsCodec
from .messages import MessagesCodec
from .responses import ResponsesCodec

# Every codec by its name (the usage event's ``endpoint``): what the body process checks a
# large body with (a Responses body without the history it may carry; the view parses again).
CODECS = {codec.name: codec for codec in (CHAT, MessagesCodec(), ResponsesCodec(),
                                          CompletionsCodec(), EmbeddingsCodec())}
