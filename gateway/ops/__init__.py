"""What runs the gateway around the requests: maintenance, the sweeper and draining
(:mod:`.lifecycle`), metrics, and the ``kiln`` command.

May import ``ledger``, ``contract`` (the catalog), ``backends`` and the shared modules; never
``api``, ``dialects`` or ``flow``.
"""
