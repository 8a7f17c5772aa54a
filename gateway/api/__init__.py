"""The views: one blueprint per endpoint family, and what reading a request may cost.

A view reads headers and the body (bounded by :mod:`.intake` and :mod:`.body_process`), hands
the body to its dialect's codec (:mod:`gateway.dialects`) and the result to the flow, and shapes
the response. May import every package below it (``dialects``, ``flow``, ``contract``,
``ledger``, ``backends``, ``ops``) and the shared modules at the top of ``gateway``.
"""
