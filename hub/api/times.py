"""Timestamps in answers: `UTCDateTime`, a datetime that always carries its UTC offset."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import AfterValidator


def _utc(value: dt.datetime) -> dt.datetime:
    """The databases store UTC without an offset (SQLite keeps none); answers carry it, so
    they are RFC 3339 date-times, as the OpenAPI document says."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


UTCDateTime = Annotated[dt.datetime, AfterValidator(_utc)]
