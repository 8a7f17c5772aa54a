"""What a client may send and what each backend family is sent: the model catalog (and the
models' local tokenizers it names), the request contract, and the body Kiln builds per family
(docs/PARAMETERS.md).

May import ``backends`` (the catalog names routing policies) and the shared modules; never
``api``, ``dialects``, ``flow``, ``ledger`` or ``ops``.
"""
