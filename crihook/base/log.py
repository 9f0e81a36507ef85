"""One line per event, `key=value` fields, journald priorities: logs meant for `journalctl -u crihook`.

Under systemd (JOURNAL_STREAM set) each line starts with `<N>`, the syslog priority journald reads
from stdout; elsewhere lines carry a timestamp instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

# logging level -> syslog priority (journald)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
_STD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
LEVELS = ("debug", "info", "warning", "error")


def _quote(value: object) -> str:
    s = str(value)
    if s == "" or any(c in s for c in ' "=\n\t'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return s


class KeyValueFormatter(logging.Formatter):
    def __init__(self, journald: bool) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        if self.journald:
            parts.append(f"<{_PRIORITY.get(record.levelno, 6)}>")
        else:
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
            parts.append(f"time={ts}.{int(record.msecs):03d}")
        parts.append(f"level={record.levelname.lower()}")
        parts.append(f"msg={_quote(record.getMessage())}")
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                parts.append(f"{key}={_quote(value)}")
        if record.exc_info:
            parts.append(f"error={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def setup(level: str = "info", stream: TextIO | None = None) -> None:
    """Configure the root logger once for the whole process."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(KeyValueFormatter(journald="JOURNAL_STREAM" in os.environ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc and kubernetes are chatty at INFO; their warnings still show.
    for noisy in ("kubernetes", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
