"""One generation's life, blind to the client's dialect: admit, route, call, meter, settle in
one ``finally``; and the table of how a generation ends (:mod:`.outcomes`).

May import ``contract``, ``ledger``, ``backends`` and the shared modules; never ``api``,
``dialects`` or ``ops``.
"""
