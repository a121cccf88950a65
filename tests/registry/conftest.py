"""Fixtures: the tiny model for live registered servers (tests/server's helpers are reused)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))  # live_server.py
sys.path.insert(0, str(Path(__file__).parent))  # registered_server.py

from live_server import load_tiny  # noqa: E402
from tiny_models import make_tiny_model_dir  # noqa: E402

from strata.model.loader import LoadedModel  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = make_tiny_model_dir(tmp_path_factory.mktemp("registry") / "tiny")
    return load_tiny(path)
