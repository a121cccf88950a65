"""The C kernels in tests: skip only where no C compiler exists at all (and fail even then where
STRATA_REQUIRE names `cc`); where one exists but
cannot build the kernels, the test fails with the compiler's message (a broken kernel must never
pass as a skip, nor leave the fallback paths to be compared with themselves)."""

from __future__ import annotations

import pytest
from required import require

from strata.model import kernel_build
from strata.model.kernel_build import KernelBuild


def require_kernels(build: KernelBuild | None = None) -> None:
    """Skip without a compiler; fail when the compiler fails; return when the kernels are built."""
    build = build if build is not None else kernel_build.kernels()
    if build.compiler is None:
        require("cc")  # a skip, or a failure where STRATA_REQUIRE names cc
    if not build.is_built:
        pytest.fail(f"{build.compiler} failed to build the C kernels:\n{build.error}",
                    pytrace=False)
