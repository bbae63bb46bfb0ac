"""Logging for every ferry process: plain text for people, one JSON object per line for machines.

The request being handled lives in a contextvar, so a log line written anywhere below a handler
(engine, kv store, ...) names its request without passing ids around:

    with request_context("req-42"):
        log.info("prefill done")     # {"ts": ..., "level": "INFO", ..., "request_id": "req-42"}
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter as JsonFormatterBase

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("ferry_request_id", default=None)
"""Id of the request this task is working on; None outside a request."""

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s%(request_suffix)s"


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Tag every log line written inside the block (and in tasks it starts) with `request_id`."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class JsonFormatter(JsonFormatterBase):
    """One JSON object per line (python-json-logger): ts, level, logger, msg, request_id (when set),
    exc (when any), plus whatever a call passes in `extra=`."""

    def __init__(self) -> None:
        super().__init__(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger", "message": "msg", "exc_info": "exc"},
            reserved_attrs=[*RESERVED_ATTRS, "taskName", "request_id", "request_suffix"],
            json_ensure_ascii=False,
        )

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        log_data["ts"] = round(record.created, 6)
        super().add_fields(log_data, record, message_dict)
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            log_data["request_id"] = request_id


class _RequestIdFilter(logging.Filter):
    """Copies the contextvar onto the record, so both formatters can show it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        rid = getattr(record, "request_id", None)
        record.request_suffix = f" [request_id={rid}]" if rid is not None else ""
        return True


def setup_logging(level: str = "INFO", json: bool = False) -> None:
    """Configure the root logger once per process (calling again replaces the previous setup)."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"level={level!r} must be one of {LEVELS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if json:
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter(_TEXT_FORMAT)
        formatter.converter = time.gmtime  # UTC, like the JSON timestamps
        handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_ferry", False):
            root.removeHandler(old)
    handler._ferry = True  # type: ignore[attr-defined]  # marks ours, so a second call replaces it
    root.addHandler(handler)
    root.setLevel(level)
