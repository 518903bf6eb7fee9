"""The server's log: one handler on stderr for this package's loggers and uvicorn's, in one
format (--log-format):

    text   2026-12-05 21:50:01,123 INFO trt_spec.access: POST /v1/chat/completions 200
           request_id=5f0c... model=tiny method=vanilla prompt_tokens=12 ... tau=2.41
    json   {"time": "2026-12-05T21:50:01.123+00:00", "level": "INFO", "logger":
            "trt_spec.access", "message": "POST /v1/chat/completions 200",
            "request_id": "5f0c...", "model": "tiny", ..., "tau": 2.41}

An access line (serve/request_log.py) carries its fields as the record's `fields`: in text
after the message as key=value (a value with spaces or odd characters JSON-quoted, so a
line stays one line), in json as top-level keys. Warnings and errors from every trt_spec
module and from uvicorn go through the same handler; the access lines (logger
trt_spec.access) at INFO, when on. uvicorn's own access log stays off: the one here has
the request id and the model's numbers.

Only these loggers are configured, never the root: under Ray Serve the replica's process is
Ray's, and its own logging stays as it is.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import datetime, timezone

from trt_spec.serve.options import LOG_FORMATS

ACCESS = "trt_spec.access"  # the access log's logger
OURS = ("trt_spec", "uvicorn")  # the loggers given the handler
BARE = re.compile(r"[\w.:/@+-]+")  # a text value written unquoted


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, then an access line's fields as key=value."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += "".join(f" {k}={text_value(v)}" for k, v in fields.items() if v is not None)
        return line


def text_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s if BARE.fullmatch(s) else json.dumps(s, ensure_ascii=True)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message, an access
    line's fields (every field, null where it has no value), and a traceback as
    `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(log_format: str = "text", access_log: bool = True) -> None:
    """This process's trt_spec and uvicorn loggers write to stderr in `log_format`:
    warnings and up, and the access lines (INFO) when access_log."""
    assert log_format in LOG_FORMATS, log_format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    for name in OURS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):  # configured again (tests, a replica restarted)
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
    logging.getLogger(ACCESS).setLevel(logging.INFO if access_log else logging.WARNING)
