"""The keys API (docs/KEYS.md): the org's keys listed and shown to a key that may read them, and
created, changed, rotated and revoked by a management key (``kiln key create ORG --manage``),
within its own org. Each change is written, with its record in ``key_changes``, by
:mod:`gateway.ledger.key_admin`; the fields are parsed by :mod:`gateway.api.key_fields`; every
key is shown as ``GET /v1/key`` shows it (:func:`gateway.ledger.keys.key_view`), never with a
secret except the new one in ``key`` when a key is created or rotated.

Changes reach every worker's key check within ``KILN_KEY_CACHE_TTL_S``, as the operator's do.
"""
from flask import Blueprint, current_app, g, jsonify, request

from ..contract.json_body import parse_json_body
from ..db import is_postgres, utcnow
from ..errors import Forbidden, InvalidRequest, NotFound, PayloadTooLarge
from ..ledger import key_admin
from ..ledger.keys import key_by_id, key_view, org_keys
from . import intake
from .auth import require_key
from .key_fields import MAX_INTEGER, key_columns

bp = Blueprint("keys", __name__)

MAX_BODY_BYTES = 64 * 1024  # a key's fields take a few hundred bytes
MAX_GRACE_PERIOD_S = 86_400


@bp.get("/keys")
@require_key
def list_keys():
    """List the caller's org's keys as ``GET /v1/key`` shows each (no secrets); a key without
    ``org_read`` (or the permission to manage keys) sees only itself."""
    engine, principal = _engine(), g.principal
    rows = org_keys(engine, principal.org_id) if principal.reads_org else \
        [key_by_id(engine, principal.key_id)]
    now = utcnow()
    return jsonify({"object": "list", "data": [key_view(row, now) for row in rows]})


@bp.get("/keys/<int:key_id>")
@require_key
def show_key(key_id):
    """Show one of the org's keys (the caller itself, or any with ``org_read``)."""
    if key_id != g.principal.key_id and not g.principal.reads_org:
        raise Forbidden("This API key may read only itself (it has no org_read).",
                        code="permission_denied")
    return _render(_target(key_id))


@bp.post("/keys")
@require_key
def create_key():
    """Create a key in the caller's org (management keys); answer its view with the new
    secret in ``key``, shown this once."""
    _require_manage()
    values = key_columns(_body(), _services().catalog, is_postgres(_engine()), utcnow())
    key_id, secret = key_admin.create(_engine(), g.principal.org_id, values, _actor())
    return _render(_target(key_id), secret=secret, status=201)


@bp.patch("/keys/<int:key_id>")
@require_key
def update_key(key_id):
    """Change a key's fields (null clears one); answer its view."""
    _changeable(_target(key_id))
    values = key_columns(_body(), _services().catalog, is_postgres(_engine()), utcnow())
    if values:
        key_admin.update(_engine(), g.principal.org_id, key_id, values, _actor())
    return _render(_target(key_id))


@bp.delete("/keys/<int:key_id>")
@require_key
def revoke_key(key_id):
    """Revoke a key (again: no change); answer its view."""
    _changeable(_target(key_id), revoking=True)
    key_admin.revoke(_engine(), g.principal.org_id, key_id, _actor())
    return _render(_target(key_id))


@bp.post("/keys/<int:key_id>/rotate")
@require_key
def rotate_key(key_id):
    """Give a key a new secret (in ``key``); the old one keeps working ``grace_period_s``."""
    _changeable(_target(key_id))
    grace_s = _grace_period_s(_body(required=False))
    secret = key_admin.rotate(_engine(), g.principal.org_id, key_id, grace_s, _actor())
    return _render(_target(key_id), secret=secret)


# -- parse, check, render ------------------------------------------------------------------------

def _services():
    return current_app.extensions["kiln"]


def _engine():
    return current_app.extensions["kiln.engine"]


def _actor():
    return key_admin.Actor(key_id=g.principal.key_id)


def _require_manage():
    if not g.principal.manage:
        raise Forbidden("This API key cannot manage keys: only a management key can (the "
                        "operator creates one with kiln key create ORG --manage).",
                        code="management_key_required")


def _target(key_id):
    """Return the org's key ``key_id`` (its row), else 404 (another org's key is not found)."""
    row = None
    if key_id <= MAX_INTEGER:
        with _engine().connect() as conn:
            row = key_admin.find_key(conn, g.principal.org_id, key_id)
    if row is None:
        raise NotFound(f"No key {key_id} in this organization.", param="id")
    return row


def _changeable(row, revoking=False):
    """Refuse a change of ``row`` the caller may not make."""
    _require_manage()
    if row.manage and row.id != g.principal.key_id:
        raise Forbidden("Another management key is the operator's to change (kiln key).",
                        code="operator_only")
    if row.revoked_at is not None and not revoking:
        raise Forbidden(f"Key {row.id} is revoked: it cannot be changed or rotated.",
                        code="key_revoked")


def _body(required=True):
    """Return the request's JSON object (an empty body is ``{}`` where none is required)."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"Request body is larger than {MAX_BODY_BYTES} bytes.")
    raw = b"".join(intake.read_body(request.stream, length, MAX_BODY_BYTES,
                                    _services().config.body_timeout_s))
    if not required and not raw.strip():
        return {}
    return parse_json_body(raw, request.content_type, MAX_BODY_BYTES)


def _grace_period_s(body):
    for name in body:
        if name != "grace_period_s":
            raise InvalidRequest(f"Unknown parameter: '{name[:100]}'.", param=name[:100],
                                 code="unknown_parameter")
    value = body.get("grace_period_s", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest("Invalid 'grace_period_s': expected an integer number of seconds.",
                             param="grace_period_s", code="invalid_type")
    if not 0 <= value <= MAX_GRACE_PERIOD_S:
        raise InvalidRequest(f"Invalid 'grace_period_s': expected 0 to {MAX_GRACE_PERIOD_S} "
                             f"seconds.", param="grace_period_s", code="invalid_value")
    return value


def _render(row, secret=None, status=200):
    view = key_view(row, utcnow())
    return jsonify({**view, "key": secret} if secret is not None else view), status
