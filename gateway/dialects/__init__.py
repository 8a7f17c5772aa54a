"""One codec per public API: the client's body in, Kiln's canonical request out; the flow's
result in, the dialect's JSON body, event stream and error envelope out.

May import ``flow``, ``contract``, ``backends`` (SSE framing) and the shared modules; never
``api``, ``ledger`` or ``ops``.
"""
from .chat import CODEC as CHAT

# Every codec by its name (the usage event's ``endpoint``): what a view or the body process
# parses a body with.
CODECS = {CHAT.name: CHAT}
