"""Logging for the router and the decode server: plain text (the default) or JSON, one
object per line (``--log-format json``), every line of a request carrying its request id
and, when tracing is on, its trace id.

The request's ids live in a :class:`~contextvars.ContextVar` set by the request's task
(:func:`bind_request`): each request runs in a task of its own, and the tasks it spawns
(the router's cancel call) inherit them, so a log call anywhere below the handler is
tagged without passing the ids along. A record's ``fields`` attribute (``extra={"fields":
{...}}``) adds structured keys (the access line's status, stage and latency).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Literal, NamedTuple, TextIO

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

__all__ = ["TEXT_FORMAT", "JsonFormatter", "LogFormat", "RequestIds", "bind_request", "configure_logging"]


class RequestIds(NamedTuple):
    request_id: str
    trace_id: str | None = None  # 32 hex digits, as OTLP writes it


_REQUEST: ContextVar[RequestIds | None] = ContextVar("pd_request_ids", default=None)


def bind_request(request_id: str, trace_id: str | None = None) -> None:
    """Tag every log line of the current task (and of the tasks it starts) with these ids."""
    _REQUEST.set(RequestIds(request_id, trace_id))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601, ms), ``level``, ``logger``,
    ``message``, ``request_id`` / ``trace_id`` when the record belongs to a request, the
    record's ``fields``, and ``exception`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids = _REQUEST.get()
        if ids is not None:
            out["request_id"] = ids.request_id
            if ids.trace_id is not None:
                out["trace_id"] = ids.trace_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: LogFormat, stream: TextIO | None = None) -> logging.Handler:
    """The root logger's one handler (stderr), text or JSON. With JSON, uvicorn must be
    given ``log_config=None`` so that its loggers propagate here instead of printing text."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
