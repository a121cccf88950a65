"""tests/required.py: a missing tool is a skip, unless STRATA_REQUIRE names it: then a failure
(what CI relies on to run every proof it can install)."""

from __future__ import annotations

from collections.abc import Iterator

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
    with pytest.raises(pytest.fail.Exception, match=r"absent is required here \(STRATA_REQUIRE"):
        required.require(absent_tool)


def test_all_names_every_tool_but_the_cpus_features() -> None:
    assert required.ALL == {"promtool", "prometheus", "chromium", "redis-server", "cc", "ray",
                            "shm"}
    assert required.CPU_FEATURES == {"amx", "avx512_bf16"}


def test_an_unknown_name_is_refused_with_the_known_ones(absent_tool: str) -> None:
    with pytest.raises(pytest.UsageError, match=r"unknown tools \['promtol'\].*promtool"):
        required.configure("promtol")
