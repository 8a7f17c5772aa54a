"""CSV exports of the account views: ``?format=csv``, or ``Accept: text/csv``, on
``GET /v1/generations`` and ``GET /v1/activity``.

An export is a streamed body (a generator) written batch by batch from keyset pages of the
database: each batch is one short query of at most :data:`BATCH_ROWS` rows, after the last row
of the one before, on a pooled connection given back before its rows are written. So a
worker's memory follows one batch, not the export, and no connection is held while a slow
client downloads (a server-side cursor would hold one, with its transaction, for the whole
download: DESIGN, "No DB connection is held while a response streams").

The CSV is RFC 4180 as Python's :mod:`csv` writes it (``\\r\\n`` line ends, quotes where
needed), UTF-8, with a header row; amounts are exact decimal strings of USD, an unknown value
is an empty cell, booleans are ``true`` / ``false``. A failure after the body began (the
database lost mid-export) ends the response without the chunked encoding's last chunk, so a
client sees a broken download, never a CSV that looks complete but is short.
"""
import csv
import io

import sqlalchemy as sa
from flask import Response

from ..errors import InvalidRequest

BATCH_ROWS = 1000
CSV, JSON = "text/csv", "application/json"
FORMATS = ("json", "csv")
# A cell a spreadsheet would run as a formula (OWASP, "CSV Injection"): such free text gets a
# leading apostrophe, which spreadsheets show as text.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def wants_csv(request):
    """Tell whether ``request`` asks for CSV: ``?format=csv`` (``json`` for JSON), else an
    ``Accept`` header that prefers ``text/csv`` to ``application/json`` (JSON on a tie and
    without the header).

    :raises InvalidRequest: ``format`` is given and is neither ``json`` nor ``csv`` (400
        ``invalid_value``, ``param: "format"``).
    """
    fmt = request.args.get("format")
    if fmt is None:
        return request.accept_mimetypes.best_match([JSON, CSV], default=JSON) == CSV
    if fmt not in FORMATS:
        raise InvalidRequest(f"Invalid 'format': expected 'json' or 'csv', got {fmt[:40]!r}.",
                             param="format", code="invalid_value")
    return fmt == "csv"


def keyset_batches(engine, page, position, batch_rows=None):
    """Yield the rows of a query as lists of at most ``batch_rows`` (None:
    :data:`BATCH_ROWS`), each list read by one query on its own short connection.

    :param page: ``(after, limit) -> Select``: the query's rows that come after the position
        ``after`` (None: from its first row) in its order, at most ``limit`` of them.
    :param position: ``row -> tuple``: a row's position in that order, unique to the row (the
        order's columns, ending with a unique one).
    """
    batch_rows = batch_rows or BATCH_ROWS
    after = None
    while True:
        with engine.connect() as conn:
            batch = conn.execute(page(after, batch_rows)).all()
        if batch:
            yield batch
        if len(batch) < batch_rows:
            return
        after = position(batch[-1])


def refuse_large_export(engine, query, max_rows, params):
    """Refuse an export of ``query`` when it has more than ``max_rows`` rows (counted no
    further than one past the bound).

    :param params: the query parameters that narrow it, for the message (``"from/to"``).
    :raises InvalidRequest: 400 ``export_too_large``, ``param`` the first of ``params``.
    """
    over = sa.select(sa.func.count()).select_from(query.limit(max_rows + 1).subquery())
    with engine.connect() as conn:
        count = conn.execute(over).scalar_one()
    if count > max_rows:
        raise InvalidRequest(f"This export has more than {max_rows} rows, the most one CSV "
                             f"export may hold: narrow it with {params} and export the parts.",
                             param=params.split("/")[0], code="export_too_large")


def csv_response(header, rows, filename):
    """Return a streamed ``text/csv`` attachment: ``header``, then the rows of each batch.

    :param header: the column names.
    :param rows: an iterable of batches, each a list of rows; a row is a sequence of cells
        (str, int, bool or None; None is an empty cell).
    :param filename: the attachment's name (ASCII, no quotes).
    """
    def body():
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(header)
        yield _drain(buffer)  # the header leaves at once: the client sees the export begin
        for batch in rows:
            writer.writerows([_cell(value) for value in row] for row in batch)
            yield _drain(buffer)
    return Response(body(), mimetype=CSV,
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})


def text_cell(value):
    """Return free text (a label, a model id) as a CSV cell a spreadsheet shows as text."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def _drain(buffer):
    data = buffer.getvalue().encode()
    buffer.seek(0)
    buffer.truncate()
    return data
