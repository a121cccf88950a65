"""The suite's one conftest at the root: `STRATA_REQUIRE` (read here, once) says which tools a
test may not skip for lack of (tests/required.py), and the `needs` marker applies it."""

from __future__ import annotations

import os

import pytest
import required


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


_REQUIRED = pytest.StashKey[frozenset[str]]()
