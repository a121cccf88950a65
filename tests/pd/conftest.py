"""Fixtures of the prefill/decode hand-off tests: one tiny model for the session; the helpers
(pd_fleet.py) sit next to the tests, the live server and gateway helpers in tests/server and
tests/gateway."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE.parent / "gateway"))

from tiny_models import make_tiny_model_dir  # noqa: E402

from strata.model.loader import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("pd") / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir, dtype="float32")
