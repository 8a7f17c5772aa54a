"""The request body as JSON: parsed, and checked for what no model server could read.

Numbers must be finite and within 64 bits (RFC 8259 has no NaN or Infinity), nesting is bounded
(:data:`MAX_DEPTH`), and text must be Unicode (no lone UTF-16 surrogate). Each error names the
``param`` at fault. The chat contract itself is :mod:`gateway.contract.validation`.
"""
import json
import math
import re

from ..errors import InvalidRequest, PayloadTooLarge

MAX_DEPTH = 64  # nesting of arrays and objects in a body (tool schemas nest; nothing needs more)


def parse_json_body(raw, content_type, max_body_bytes):
    """Parse the raw request body into a dict.

    Numbers must be finite and in range anywhere in the body (``1e400``, ``NaN`` and integers
    beyond 64 bits are refused: RFC 8259 has no NaN or Infinity, and a model server could not
    read them), and nesting is bounded (:data:`MAX_DEPTH`); both errors name the ``param``.

    :raises PayloadTooLarge: over ``max_body_bytes`` (413).
    :raises InvalidRequest: not ``application/json``, empty, not JSON, not an object, a
        non-finite or out-of-range number, or nested too deeply (400).
    """
    if len(raw) > max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {max_body_bytes} bytes.")
    mimetype = (content_type or "").split(";")[0].strip().lower()
    if mimetype != "application/json":
        raise InvalidRequest("Content-Type must be application/json.", code="invalid_content_type")
    if not raw.strip():
        raise InvalidRequest("Request body is empty: send a JSON object.", code="invalid_json")
    suspect = []  # a non-finite number was read; found again, with its path, after the parse
    try:
        body = json.loads(raw, parse_constant=lambda name: _suspect(suspect, float(name)),
                          parse_float=lambda text: _suspect(suspect, float(text)))
    except RecursionError as err:
        raise _too_deep(raw) from err
    except (ValueError, UnicodeDecodeError) as err:
        if "integer string conversion" in str(err):  # Python's bound on integer digits
            raise InvalidRequest("Request body holds an integer too long to be a number Kiln "
                                 "accepts.", code="invalid_value") from err
        raise InvalidRequest(f"Request body is not valid JSON: {err}", code="invalid_json") from err
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    check_depth(body, raw)
    encoded = raw if isinstance(raw, bytes) else raw.encode()
    if suspect or _LONG_INTEGER.search(encoded):
        _check_numbers(body, "")
    if _SURROGATE_ESCAPE.search(encoded):  # paired (an escaped emoji) or not: look closer
        _check_text(body, "")
    return body


_LONG_INTEGER = re.compile(rb"\d{19}")  # only then can an integer be beyond 64 bits
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only then can text hold a surrogate
_INT_RANGE = (-2**63, 2**64 - 1)


def _suspect(found, value):
    if not math.isfinite(value):
        found.append(value)
    return value


def _check_numbers(value, path):
    """Raise 400 naming the first number under ``value`` that is not finite or in range."""
    if isinstance(value, dict):
        for key, child in value.items():
            _check_numbers(child, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            _check_numbers(child, f"{path}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value) or (
            type(value) is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]):
        raise InvalidRequest(f"Invalid '{path[:200]}': every number must be finite and "
                             f"within 64 bits.", param=path[:200], code="invalid_value")


def _check_text(value, path):
    """Raise 400 naming the first string under ``value`` (member names too) holding a lone
    UTF-16 surrogate (``"\\ud800"`` unpaired): it is no Unicode character, UTF-8 cannot carry
    it, and model servers fail on it (llama-cpp-python answers 500)."""
    if isinstance(value, dict):
        for key, child in value.items():
            where = f"{path}.{key}" if path else str(key)
            _check_text(key, where)
            _check_text(child, where)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            _check_text(child, f"{path}[{i}]")
    elif isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            where = path.encode("utf-8", "replace").decode()[:200]
            raise InvalidRequest(f"Invalid '{where}': the text holds an unpaired UTF-16 "
                                 f"surrogate (an escape in \\ud800-\\udfff without its pair), "
                                 f"which is not a Unicode character.", param=where,
                                 code="invalid_value") from None


def check_depth(value, raw=b"", limit=MAX_DEPTH):
    """Raise 400 if ``value`` nests arrays and objects deeper than ``limit``."""
    level = [value]
    for _ in range(limit):
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return
    raise _too_deep(raw)


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _deep_member(raw):
    """Return the top-level member of ``raw`` (JSON text) that nests past :data:`MAX_DEPTH`,
    found by scanning its strings and brackets, or None."""
    depth, last_string, member = 0, None, None
    for token in _TOKEN.finditer(raw if isinstance(raw, bytes) else raw.encode()):
        text = token.group()
        if text[:1] == b'"':
            last_string = text if depth == 1 else last_string
        elif text in (b"[", b"{"):
            member = last_string if depth == 1 else member
            depth += 1
            if depth > MAX_DEPTH:  # the body object itself is the first level
                return _member_name(member)
        else:
            depth -= 1
    return None


def _member_name(token):
    try:
        return json.loads(token)[:200] if token else None
    except ValueError:
        return None


def _too_deep(raw):
    return InvalidRequest(f"Request body is nested more than {MAX_DEPTH} levels deep.",
                          param=_deep_member(raw), code="invalid_json")
