"""strata/progress.py: a bar on a terminal, log lines every few seconds elsewhere, nothing when
disabled. Its users: tests/model/test_fetch.py (download, extraction), tests/bench/test_loadgen.py
(requests done/total)."""

from __future__ import annotations

import io
import logging

import pytest

from strata import logs
from strata.clock import ManualClock
from strata.logs import LogConfig
from strata.progress import BarProgress, NoProgress, Progress, format_amount, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_come_every_interval_and_once_at_the_end(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    caplog.set_level(logging.INFO, logger="strata.progress")
    with Progress(200e6, "fetching x", unit="B", log_every_s=5.0, clock=clock) as bar:
        bar.update(10e6)
        clock.advance(4.9)
        bar.update(40e6)  # 4.9 s: not yet
        clock.advance(0.1)
        bar.update(40e6)  # 5.0 s: a line
        clock.advance(1.0)
        bar.update(10e6)
    assert [r.getMessage() for r in caplog.records] == [
        "fetching x: 90.0 MB of 200.0 MB (45%)",
        "fetching x: done, 100.0 MB of 200.0 MB (50%) in 6.0s",
    ]


def test_an_unknown_total_shows_the_count_and_a_failure_logs_no_done_line(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    caplog.set_level(logging.INFO, logger="strata.progress")
    with pytest.raises(RuntimeError), Progress(None, "requests", unit="req", log_every_s=1.0,
                                               clock=clock) as bar:
        clock.advance(1.0)
        bar.update(3)
        raise RuntimeError("the work failed")
    assert [r.getMessage() for r in caplog.records] == ["requests: 3 req"]


def test_amounts_are_readable() -> None:
    assert format_amount(512, "B") == "512 B"
    assert format_amount(1500, "B") == "1.5 kB"
    assert format_amount(98_000_000, "B") == "98.0 MB"
    assert format_amount(3e12, "B") == "3000.0 GB"
    assert format_amount(12, "tensors") == "12 tensors"
    assert Progress(32, "requests", unit="req", clock=ManualClock()).status() == "0/32 req (0%)"


def test_the_kind_follows_the_stream_and_the_log_format() -> None:
    assert type(progress(10, "x", stream=io.StringIO())) is Progress
    bar = progress(10, "x", stream=Terminal())
    assert isinstance(bar, BarProgress)
    bar.update(10)
    bar.close()
    assert "10/10" in bar.bar.fp.getvalue()  # type: ignore[attr-defined]
    assert isinstance(progress(10, "x", enabled=False, stream=Terminal()), NoProgress)
    logs.configure(LogConfig(format="json"), io.StringIO())
    try:
        assert type(progress(10, "x", stream=Terminal())) is Progress  # JSON logs: no bar
    finally:
        logs.reset()
