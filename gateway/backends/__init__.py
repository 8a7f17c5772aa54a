"""The fleet: which backend (routing, health, capacity), the upstream call, the stream relay
and SSE framing. Knows nothing of money.

May import only the shared modules at the top of ``gateway``.
"""
