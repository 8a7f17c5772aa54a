"""How a generation can end, in the words every layer shares: the usage event's statuses and
the ending codes (``usage_events.error_code``, the error envelope's ``code``).

The bottom of the package: imports nothing of Kiln's, so the tables (:mod:`gateway.models`),
the ledger and the migrations name statuses without pulling in the flow or the relay. Which
exception ends in which status and code is decided once, in :mod:`gateway.flow.outcomes`.
"""
from enum import Enum


class Status(str, Enum):
    """A usage event's status (``usage_events.status``)."""

    PENDING = "pending"                    # admitted, not settled yet
    COMPLETED = "completed"                # the generation ended normally (also at its budget)
    CLIENT_CANCELLED = "client_cancelled"  # the client left first
    REJECTED = "rejected"                  # the backend refused the request (4xx)
    UPSTREAM_ERROR = "upstream_error"      # the backend failed or was unreachable
    TIMEOUT = "timeout"                    # the backend was too slow (connect, first byte, idle)
    ABANDONED = "abandoned"                # the worker was lost; closed by the sweeper
    INTERRUPTED = "interrupted"            # the operator stopped the worker (shutdown, reload)
    ERROR = "error"                        # Kiln itself failed


CLIENT_CLOSED = 499  # nginx's code for a client that closed the connection first

# Ending codes. One code per ending, wherever it is written (the flow's table, the sweeper,
# the activity rollup, the client's error event).
LEASE_EXPIRED = "lease_expired"            # the lease ran out; the sweeper closed the generation
SHUTTING_DOWN = "server_shutting_down"     # the worker stopped before the generation ended
UPSTREAM_REJECTED = "upstream_rejected"    # the backend refused the request (4xx)
UPSTREAM_ERROR = "upstream_error"          # the backend failed (5xx, reset, malformed reply)
UPSTREAM_TOO_LARGE = "upstream_too_large"  # an event or reply over Kiln's size bound
UNREACHABLE = "upstream_unreachable"       # no connection could be made
CONNECT_TIMEOUT = "upstream_connect_timeout"
FIRST_BYTE_TIMEOUT = "upstream_first_byte_timeout"
IDLE_TIMEOUT = "upstream_idle_timeout"
INTERNAL_ERROR = "internal_error"          # Kiln itself failed
