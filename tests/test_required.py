"""tests/required.py: a missing tool is a skip, unless STRATA_REQUIRE names it: then a failure
(what CI relies on to run every proof it can install)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import required


@pytest.fixture
def absent_tool(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setitem(required.TOOLS, "absent", required.Tool(
        "absent", lambda: False, "absent is not installed (apt-get install absent)"))
    monkeypatch.setattr(required, "ALL", required.ALL | {"absent"})
    before = ",".join(required.required_names())
    yield "absent"
    required.configure(before)


def test_a_missing_tool_is_a_skip_that_says_how_to_install_it(absent_tool: str) -> None:
    required.configure("")
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install absent"):
        required.require(absent_tool)


@pytest.mark.parametrize("setting", ["absent", "all", "promtool, absent"])
def test_a_required_tool_that_is_missing_fails(absent_tool: str, setting: str) -> None:
    required.configure(setting)
    # any outcome caught, then its kind asserted: a skip (what CI must never get here) would
    # otherwise pass through pytest.raises(fail) and report this test as skipped, not failed
    with pytest.raises(BaseException) as got:
        required.require(absent_tool)
    assert got.type is pytest.fail.Exception, f"a {got.type.__name__}, not a failure: {got.value}"
    assert "absent is required here (STRATA_REQUIRE" in str(got.value)


def test_all_names_every_tool_but_the_cpus_features() -> None:
    assert required.ALL == {"promtool", "prometheus", "chromium", "redis-server", "cc", "ray",
                            "shm"}
    assert required.CPU_FEATURES == {"amx", "avx512_bf16"}


def test_an_unknown_name_is_refused_with_the_known_ones(absent_tool: str) -> None:
    with pytest.raises(pytest.UsageError, match=r"unknown tools \['promtol'\].*promtool"):
        required.configure("promtol")


def test_ci_installs_the_debian_tools_and_requires_all() -> None:
    """.ci/run: without its `STRATA_REQUIRE=all` (or a tool left out of its installs) a missing
    tool's proofs would be skips in CI again."""
    run = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    required_line = run.index("export STRATA_REQUIRE=${STRATA_REQUIRE-all}\n")
    assert required_line < run.rindex("\nmake test"), "STRATA_REQUIRE is set after the tests"
    installed = re.search(r"declare -A PACKAGE_OF=\(([^)]*)\)", run)
    assert installed is not None
    assert set(re.findall(r"\[([\w-]+)\]=", installed.group(1))) == {
        "promtool", "prometheus", "chromium", "cc"}
