"""How every Strata process writes its log: `--log-format text` (the default) or `json`.

strata/cli.py runs each command inside `configured(...)`, with what the flags and environment
say; nothing else installs handlers. Records go to stderr:

    text   INFO strata.gateway: [REQUEST_ID] message
    json   {"time": "2026-12-01T16:11:00.123+00:00", "level": "INFO", "logger": "strata.gateway",
            "message": "...", "request_id": "..."}        (one object per line)

`request_id` is the `X-Request-Id` of the HTTP request being served when the record was made
(strata/protocol/request_id.py), absent outside a request; an exception's traceback is
`exc_info`. uvicorn is started with `log_config=None`, so its own lines, the access log included,
go through the same handler. `announce` prints a process's one-line announcements (ready,
stopping) to stdout in the same format, whatever the log level. Child processes get the format
as `--log-format` (`child_flags`).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TextIO

from strata.errors import ConfigError
from strata.protocol.request_id import current_request_id

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# chatty libraries: one line per HTTP call they make; shown only at debug
_QUIET_BELOW_DEBUG = ("httpx", "httpcore")


@dataclass(frozen=True, slots=True)
class LogConfig:
    format: str = "text"
    level: str = "info"

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ConfigError(f"log format {self.format!r} is not one of {', '.join(LOG_FORMATS)}")
        if self.level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log level {self.level!r} is not one of {', '.join(LOG_LEVELS)}")

    @property
    def is_json(self) -> bool:
        return self.format == "json"


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (json.dumps escapes newlines)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            data["request_id"] = request_id
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(data, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`LEVEL logger: message`, with `[request id]` before the message inside a request."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        prefix = f"[{request_id}] " if request_id else ""
        line = f"{record.levelname} {record.name}: {prefix}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class _StrataHandler(logging.StreamHandler):
    """The handler `configure` installs (and replaces when called again). Without a stream of
    its own it writes to whatever sys.stderr is when a record comes (as logging's last resort
    does), so a replaced stderr never leaves it writing to a closed file."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.follows_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self.follows_stderr:
            self.stream = sys.stderr
        super().emit(record)


_active = LogConfig()
_level_before: int | None = None  # the root level `configure` replaced; `reset` restores it


def formatter_for(config: LogConfig) -> logging.Formatter:
    return JsonFormatter() if config.is_json else TextFormatter()


def configure(config: LogConfig, stream: TextIO | None = None) -> None:
    """Route every logger through one handler on `stream` (default stderr) in `config`'s
    format, at `config.level`. Calling it again replaces that handler."""
    reset()
    global _active, _level_before
    _active = config
    handler = _StrataHandler(stream)
    handler.setFormatter(formatter_for(config))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    _level_before = root.level
    root.setLevel(config.level.upper())
    quiet = "DEBUG" if config.level.lower() == "debug" else "WARNING"
    for name in _QUIET_BELOW_DEBUG:
        logging.getLogger(name).setLevel(quiet)
    logging.captureWarnings(True)  # a warning is a log line too (JSON in json format)


def reset() -> None:
    """Undo `configure`: its handler removed, the root level back, text format again."""
    global _active, _level_before
    _active = LogConfig()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StrataHandler)]:
        root.removeHandler(handler)
    if _level_before is not None:
        root.setLevel(_level_before)
        _level_before = None
        logging.captureWarnings(False)


@contextmanager
def configured(config: LogConfig) -> Iterator[None]:
    """`configure` for the duration of a command (what strata/cli.py runs a command in)."""
    configure(config)
    try:
        yield
    finally:
        reset()


def active() -> LogConfig:
    """What `configure` was last given (text at info before any call)."""
    return _active


def announce(message: str, *, logger: str = "strata", stream: TextIO | None = None) -> None:
    """Print a one-line announcement to stdout: as is in text format, as a JSON record (level
    INFO) in json format. Not filtered by the log level: readiness lines are read by people
    and by the tools that start Strata."""
    out = stream if stream is not None else sys.stdout
    if _active.is_json:
        record = logging.LogRecord(logger, logging.INFO, __file__, 0, message, None, None)
        RequestIdFilter().filter(record)
        message = JsonFormatter().format(record)
    print(message, file=out, flush=True)


def child_flags(config: LogConfig | None = None) -> list[str]:
    """The flags that give a child process this process's log format."""
    return ["--log-format", (config or _active).format]


__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "LogConfig", "RequestIdFilter",
           "TextFormatter", "active", "announce", "child_flags", "configure", "configured",
           "formatter_for", "reset"]
