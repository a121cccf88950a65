"""Progress of long work (a model download, a conversion, a benchmark, a capacity plan).

    with progress(total=len(items), desc="planning", unit="scenario") as bar:
        for item in items:
            ...
            bar.update(1)

On a terminal (and with the text log format) it is a tqdm bar on stderr. Otherwise (a log
file, a container, `--log-format json`) it is a log line on the `strata.progress` logger every
`log_every_s` seconds, and one when the work ends, so that a log shows the work advancing
without a line per item. `enabled=False` shows nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

from strata.clock import Clock
from strata.logs import active

log = logging.getLogger("strata.progress")
DEFAULT_LOG_EVERY_S = 5.0


def format_amount(value: float, unit: str) -> str:
    """`12.3 MB` for bytes (unit "B"), else `12 unit`."""
    if unit == "B":
        for prefix in ("", "k", "M", "G"):
            if abs(value) < 1000 or prefix == "G":
                return f"{value:.1f} {prefix}B" if prefix else f"{value:.0f} B"
            value /= 1000
    return f"{value:g} {unit}"


class Progress:
    """Counts work toward `total` (None: unknown); reports it as log lines."""

    def __init__(self, total: float | None, desc: str, *, unit: str = "it",
                 log_every_s: float = DEFAULT_LOG_EVERY_S,
                 clock: Clock = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = 0.0
        self.log_every_s = log_every_s
        self.clock = clock
        self.logger = logger
        self.started_at = self.last_logged_at = clock()
        self._lock = threading.Lock()

    def update(self, amount: float = 1) -> None:
        """Add `amount` done; safe from several threads (boto3 reports from its workers)."""
        with self._lock:
            self.done += amount
            now = self.clock()
            if now - self.last_logged_at < self.log_every_s:
                return
            self.last_logged_at = now
        self.logger.info("%s: %s", self.desc, self.status())

    def status(self) -> str:
        """`45.0 MB of 98.0 MB (46%)`, `12/32 req (38%)`, or `12 req` (total unknown)."""
        if not self.total:
            return format_amount(self.done, self.unit)
        percent = f"({100.0 * self.done / self.total:.0f}%)"
        if self.unit == "B":
            return f"{format_amount(self.done, 'B')} of {format_amount(self.total, 'B')} {percent}"
        return f"{self.done:g}/{self.total:g} {self.unit} {percent}"

    def close(self) -> None:
        took_s = self.clock() - self.started_at
        self.logger.info("%s: done, %s in %.1fs", self.desc, self.status(), took_s)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()


class BarProgress(Progress):
    """The same counts shown as a tqdm bar (on a terminal)."""

    def __init__(self, total: float | None, desc: str, *, unit: str = "it",
                 stream: TextIO | None = None) -> None:
        super().__init__(total, desc, unit=unit)
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B",
                        file=stream if stream is not None else sys.stderr)

    def update(self, amount: float = 1) -> None:
        self.done += amount
        self.bar.update(amount)

    def close(self) -> None:
        self.bar.close()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class NoProgress(Progress):
    """Counts and shows nothing."""

    def update(self, amount: float = 1) -> None:
        self.done += amount

    def close(self) -> None:
        pass


def progress(total: float | None, desc: str, *, unit: str = "it", enabled: bool = True,
             stream: TextIO | None = None,
             log_every_s: float = DEFAULT_LOG_EVERY_S) -> Progress:
    """A bar when `stream` (default stderr) is a terminal and logs are text, else log lines."""
    if not enabled:
        return NoProgress(total, desc, unit=unit)
    out = stream if stream is not None else sys.stderr
    if out.isatty() and not active().is_json:
        return BarProgress(total, desc, unit=unit, stream=out)
    return Progress(total, desc, unit=unit, log_every_s=log_every_s)


__all__ = ["BarProgress", "NoProgress", "Progress", "format_amount", "progress"]
