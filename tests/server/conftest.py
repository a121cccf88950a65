"""Fixtures: one tiny model for the session; live servers per module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # live_server.py sits next to the tests

from live_server import LiveServer, load_tiny, start_server  # noqa: E402
from tiny_models import make_tiny_model_dir  # noqa: E402

from strata.model.loader import LoadedModel  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = make_tiny_model_dir(tmp_path_factory.mktemp("server") / "tiny")
    return load_tiny(path)


@pytest.fixture(scope="module")
def live(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    server = start_server(tiny_model, max_body_bytes=64 * 1024)
    yield server
    server.stop()
