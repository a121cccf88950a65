"""The suite's one conftest at the root: `STRATA_REQUIRE` (read here, once) says which tools a
test may not skip for lack of (tests/required.py), and the `needs` marker applies it.
`--record-durations=FILE` writes the seconds each test file took (setup, call and teardown of
every test in it, module fixtures included): what tests/split.py balances `make test` by."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import required


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", default=None, metavar="FILE",
                     help="write {test file: seconds} of this run to FILE (tests/split.py)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(*tools): the test needs these tools "
                            "(tests/required.py); skipped without them unless STRATA_REQUIRE "
                            "names them")
    names = required.configure(os.environ.get("STRATA_REQUIRE", ""))
    if names:
        config.stash[_REQUIRED] = names


def pytest_report_header(config: pytest.Config) -> str | None:
    names = config.stash.get(_REQUIRED, None)
    return f"required tools (STRATA_REQUIRE): {', '.join(sorted(names))}" if names else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in item.iter_markers("needs"):
        for name in marker.args:
            required.require(name)


_seconds_by_file: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_by_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--record-durations")
    if target:
        rounded = {path: round(s, 2) for path, s in sorted(_seconds_by_file.items())}
        Path(target).write_text(json.dumps(rounded, indent=1) + "\n")


_REQUIRED = pytest.StashKey[frozenset[str]]()
