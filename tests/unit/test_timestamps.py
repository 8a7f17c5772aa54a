"""Timestamps as customers read them: ISO 8601 with the offset, whichever database stored them
(SQLite hands them back naive; they are UTC)."""
from datetime import datetime, timedelta, timezone

from gateway.db import iso_utc


def test_a_naive_timestamp_is_read_as_utc_and_shown_with_its_offset():
    assert iso_utc(datetime(2026, 12, 2, 3, 4, 5, 600)) == "2026-12-02T03:04:05.000600+00:00"


def test_an_aware_timestamp_keeps_its_offset_and_none_stays_none():
    plus_two = datetime(2026, 12, 2, 5, 0, tzinfo=timezone(timedelta(hours=2)))
    assert iso_utc(plus_two) == "2026-12-02T05:00:00+02:00"
    assert iso_utc(None) is None
