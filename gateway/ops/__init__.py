"""What runs the gateway around the requests: maintenance, the sweeper and draining
(:mod:`.lifecycle`), metrics, webhook delivery (:mod:`.webhooks`), traces (:mod:`.tracing`,
:mod:`.otel`), and the ``kiln`` command.

May import ``ledger``, ``contract`` (the catalog), ``backends`` and the shared modules; never
``api``, ``dialects`` or ``flow``.
"""
