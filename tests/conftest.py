"""The suite's one conftest at the root: `STRATA_REQUIRE` (read here, once) says which tools a
test may not skip for lack of (tests/required.py), and the `needs` marker applies it.
`--record-durations=FILE` writes the seconds each test file took (setup, call and teardown of
every test in it, module fixtures included): what tests/split.py balances `make test` by.
`--record-cpu=FILE` writes the CPU seconds each file cost, the pytest process's and those of every
process it started (tests/cpu_time.py): what a file costs the other part running beside it."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import cpu_time
import pytest
import required

from strata.cache_dirs import cache_dir_from_env
from strata.model import kernel_build

# One kernel cache for the whole run, whatever cache directory a test gives its processes: the
# C kernels compile once (2.5 s of CPU) instead of once per instance and rank. The processes
# read it from the environment (strata/cli.py), this one is told.
os.environ.setdefault("STRATA_KERNEL_CACHE_DIR", str(cache_dir_from_env(os.environ) / "kernels"))
kernel_build.use_cache_dir(Path(os.environ["STRATA_KERNEL_CACHE_DIR"]))


def _share_httpx_ssl_context() -> None:
    """httpx builds an SSL context for every client it makes, loading the CA bundle: ~37 ms of
    CPU, paid by each module-level `httpx.get(...)` of a test even to a plain http:// URL on the
    loopback, and the tests poll with those every 50 ms. In this process one context made with
    httpx's defaults serves every client that asks for those defaults (the same bundle and the
    same verification: an SSL context is made to be shared). Other settings get their own."""
    from httpx._transports import default as transports

    make = transports.create_ssl_context
    shared: dict[bool, Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = make(verify=verify, cert=cert, trust_env=trust_env)
        return shared[trust_env]

    transports.create_ssl_context = create_ssl_context


_share_httpx_ssl_context()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", default=None, metavar="FILE",
                     help="write {test file: seconds} of this run to FILE (tests/split.py)")
    parser.addoption("--record-cpu", default=None, metavar="FILE",
                     help="write {test file: CPU seconds of pytest and its processes} to FILE")


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


_cpu_by_file: defaultdict[str, float] = defaultdict(float)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> object:
    if not item.config.getoption("--record-cpu"):
        return (yield)
    before = cpu_time.tree_cpu_seconds()
    outcome = yield
    _cpu_by_file[item.nodeid.split("::", 1)[0]] += cpu_time.tree_cpu_seconds() - before
    return outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    for option, by_file in (("--record-durations", _seconds_by_file),
                            ("--record-cpu", _cpu_by_file)):
        target = session.config.getoption(option)
        if target:
            rounded = {path: round(s, 2) for path, s in sorted(by_file.items())}
            Path(target).write_text(json.dumps(rounded, indent=1) + "\n")


_REQUIRED = pytest.StashKey[frozenset[str]]()
