"""Logging for every process of the mesh: plain lines for a terminal, or one JSON object per line for a log
shipper (`--log-format json`, env DEEPINFER_LOG_FORMAT=json).

    {"time": "2026-12-01T10:41:07.123Z", "level": "INFO", "service": "gateway", "instance": "gateway-0",
     "logger": "services.gateway.service", "message": "...", "exception": "Traceback ..."}   (exception: if any)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, instance: str) -> None:
        super().__init__()
        self.service, self.instance = service, instance

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "instance": self.instance,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["exception"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(service: str, instance: str, log_format: str = "text") -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service, instance))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {instance} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("DEEPINFER_LOG_LEVEL", "INFO").upper())
    logging.getLogger("nats").setLevel(logging.WARNING)
    if log_format == "json":  # a crash's traceback is one JSON line too, not raw text in the middle of them
        crash = logging.getLogger(service)
        sys.excepthook = lambda kind, exc, tb: crash.critical("%s: %s", kind.__name__, exc, exc_info=(kind, exc, tb))
