"""The body of ``POST /v1/keys`` and ``PATCH /v1/keys/{id}`` (docs/KEYS.md): the key view's own
field names in, ``api_keys`` column values out, each refused with a 400 naming its ``param``.

``label``, ``limit_usd`` (an exact decimal string of USD, as ``kiln key create --limit`` takes
it), ``limit_reset`` (``daily``, ``weekly``, ``monthly``, ``never``), ``rate_limit``
(``{"requests_per_minute": n}``, as the view shows it; ``requests_per_minute`` alone is the
same), ``in_flight_limit``, ``expires_at`` (ISO 8601 with a UTC offset, in the future),
``models`` (catalog ids), ``org_read``; null clears a field (no limit, every model, never
expires). ``manage`` may only be false: a management key is the operator's to create.
"""
from datetime import datetime, timezone
from decimal import Decimal

from ..db import storable_text
from ..errors import Forbidden, InvalidRequest, UnknownParameter
from ..ledger.keys import RESETS
from ..models import api_keys
from ..ops.cli_keys import MAX_LIMIT_USD, PLAIN_DECIMAL

MAX_INTEGER = 2**31 - 1  # the INTEGER columns (Postgres: 32 bits)
LABEL_CHARS = api_keys.c.name.type.length


def key_columns(body, catalog, postgres, now):
    """Return the ``api_keys`` values ``body`` sets (absent fields are left out).

    :param catalog: the model catalog (``models`` must name its ids).
    :param postgres: the database is Postgres (the largest ``limit_usd`` depends on it).
    :param now: aware UTC; ``expires_at`` must be after it.
    :raises UnknownParameter: a field the key view does not have (400).
    :raises InvalidRequest: a wrong type or value (400 ``invalid_type``/``invalid_value``).
    :raises Forbidden: ``manage: true`` (403 ``operator_only``).
    """
    for name in body:
        if name not in PARSERS:
            raise UnknownParameter(name[:100])
    if "rate_limit" in body and "requests_per_minute" in body:
        raise InvalidRequest("Give 'rate_limit' or 'requests_per_minute', not both.",
                             param="requests_per_minute", code="invalid_value")
    values = {}
    for name, value in body.items():
        column, parse = PARSERS[name]
        parsed = parse(value, catalog=catalog, postgres=postgres, now=now)
        if column is not None:
            values[column] = parsed
    return values


def _label(value, **_):
    if value is None or storable_text(value, LABEL_CHARS):
        return value
    raise _invalid("label", f"a string of at most {LABEL_CHARS} characters without control "
                            f"characters, or null")


def _limit_usd(value, postgres, **_):
    if value is None:
        return None
    if not isinstance(value, str) or not PLAIN_DECIMAL.fullmatch(value):
        raise _invalid("limit_usd", "an exact decimal string of USD such as \"10.00\", or null",
                       "invalid_type" if not isinstance(value, str) else "invalid_value")
    amount = Decimal(value)
    if amount < 0 or amount != amount.quantize(Decimal("1e-9")) \
            or amount > MAX_LIMIT_USD[postgres]:
        raise _invalid("limit_usd", f"from 0 to {MAX_LIMIT_USD[postgres]:f} USD with at most 9 "
                                    f"decimal places (spend is counted in nano-dollars)")
    return amount


def _limit_reset(value, **_):
    if value is None or value == "never":
        return None
    if value in RESETS:
        return value
    raise _invalid("limit_reset", "one of 'daily', 'weekly', 'monthly', 'never'")


def _rate_limit(value, **_):
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"requests_per_minute"}:
        raise _invalid("rate_limit", "an object {\"requests_per_minute\": n}, or null",
                       "invalid_type")
    return _count(value["requests_per_minute"], "rate_limit.requests_per_minute")


def _requests_per_minute(value, **_):
    return None if value is None else _count(value, "requests_per_minute")


def _in_flight_limit(value, **_):
    return None if value is None else _count(value, "in_flight_limit")


def _count(value, param):
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(param, "an integer", "invalid_type")
    if not 1 <= value <= MAX_INTEGER:
        raise _invalid(param, f"from 1 to {MAX_INTEGER}")
    return value


def _expires_at(value, now, **_):
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) and len(value) < 64 \
            else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise _invalid("expires_at", "an ISO 8601 time with a UTC offset, such as "
                                     "\"2027-01-01T00:00:00Z\", or null")
    if when <= now:
        raise _invalid("expires_at", f"a time after now ({now.isoformat()})")
    return when.astimezone(timezone.utc)  # SQLite keeps the wall time alone


def _models(value, catalog, **_):
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _invalid("models", "a non-empty array of model ids, or null for every model",
                       "invalid_type")
    for i, model in enumerate(value):
        if not isinstance(model, str) or catalog.get(model) is None:
            raise InvalidRequest(f"Invalid 'models[{i}]': {str(model)[:100]!r} is not a model "
                                 f"of the catalog (GET /v1/models).", param=f"models[{i}]",
                                 code="invalid_value")
    return sorted(set(value))


def _org_read(value, **_):
    if isinstance(value, bool):
        return value
    raise _invalid("org_read", "a boolean", "invalid_type")


def _manage(value, **_):
    if value is False:
        return None
    if value is True:
        raise Forbidden("A management key cannot create or make another management key; "
                        "the operator does (kiln key create ORG --manage).", param="manage",
                        code="operator_only")
    raise _invalid("manage", "false (a management key is the operator's to create)",
                   "invalid_type")


def _invalid(param, expected, code="invalid_value"):
    return InvalidRequest(f"Invalid '{param}': expected {expected}.", param=param, code=code)


# field -> (api_keys column, or None when nothing is stored; parser)
PARSERS = {
    "label": ("name", _label), "limit_usd": ("limit_usd", _limit_usd),
    "limit_reset": ("limit_reset", _limit_reset), "rate_limit": ("rpm_limit", _rate_limit),
    "requests_per_minute": ("rpm_limit", _requests_per_minute),
    "in_flight_limit": ("in_flight_limit", _in_flight_limit),
    "expires_at": ("expires_at", _expires_at), "models": ("allowed_models", _models),
    "org_read": ("org_read", _org_read), "manage": (None, _manage),
}
