"""Fixtures of the cancellation stories: one tiny model for the session; the live server, P/D
fleet, gateway and resume helpers are the ones of tests/server, tests/pd and tests/gateway."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
for folder in ("server", "pd", "gateway"):
    sys.path.insert(0, str(HERE.parent / folder))

from tiny_models import make_tiny_model_dir  # noqa: E402

from strata.model.loader import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("cancel") / "tiny"),
                      dtype="float32")
