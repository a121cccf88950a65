"""Fixtures: a keyed simulated instance and gateway (two tenants and an operator), per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sim_stack import Targets, sim_stack


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    with sim_stack(tmp_path_factory.mktemp("keyed"), keyed=True) as running:
        yield running
