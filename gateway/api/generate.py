"""What every generating view does, whatever its dialect: read the body (:mod:`.bodies`), parse
it with the dialect's codec, check the key may use the model and that Kiln is not in
maintenance, and hand the canonical request to the flow (README "API": auth, validation,
maintenance, admission, backend, relay, settlement)."""
from flask import current_app, g, request

from ..errors import Forbidden
from ..flow.life import respond
from ..ops import lifecycle
from .bodies import read_body


def generate(codec, parse=None, on_answer=None):
    """Answer this request's generation in ``codec``'s dialect.

    :param parse: ``(body, body bytes) -> canonical request``; ``codec.parse`` with the
        catalog by default.
    :param on_answer: ``canonical request -> the flow's on_answer callback, or None``
        (:func:`gateway.flow.life.respond`).
    :raises GatewayError: refused before any byte of the answer (400, 403, 404, 413, 503, ...).
    """
    services = current_app.extensions["kiln"]
    body, body_bytes, checked = read_body(services, current_app.extensions["kiln.parse_budget"],
                                          codec.name)
    if parse is not None:
        parsed = parse(body, body_bytes)
    else:  # a large body's codec already ran in the child process: not again here
        parsed = checked if checked is not None else \
            codec.parse(body, services.catalog, body_bytes)
    check_model(parsed.entry.id)
    lifecycle.check_maintenance()
    # Image hosts are resolved last: the lookups a request may cost come after every check
    # that needs none, and within its org's share (gateway/contract/image_hosts.py).
    current_app.extensions["kiln.image_hosts"].vouch(getattr(parsed, "image_lookups", ()),
                                                     g.principal.org_id)
    return respond(services, g.principal, parsed, codec, request.environ,
                   on_answer(parsed) if on_answer is not None else None)


def check_model(model_id):
    """Refuse a model outside the calling key's allow-list, and every model to a management
    key (it manages keys: docs/KEYS.md).

    :raises Forbidden: 403 ``model_not_allowed``; 403 ``management_key`` (a management key).
    """
    if g.principal.manage:
        raise Forbidden("A management key manages the organization's keys and cannot call "
                        "models; use one of the keys it creates.", param="model",
                        code="management_key")
    if not g.principal.may_use(model_id):
        raise Forbidden(f"This API key may not use model '{model_id}'.", param="model",
                        code="model_not_allowed")
