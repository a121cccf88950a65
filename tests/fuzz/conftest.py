"""Fixtures: a simulated instance and a gateway over it, real processes, once per module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fuzz_targets.py sits next to the tests

from fuzz_targets import Targets, fuzz_targets  # noqa: E402


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    with fuzz_targets(tmp_path_factory.mktemp("fuzz")) as running:
        yield running
