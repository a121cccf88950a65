"""Fixtures: a simulated instance and a gateway over it, real processes, once per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sim_stack import Targets, sim_stack


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    with sim_stack(tmp_path_factory.mktemp("fuzz")) as running:
        yield running
