"""Fixtures of the parallel tests: the nine-head tiny model (T=2 splits its heads 5 + 4), its
weights prepared for the ranks, and one process's greedy answers to compare them with."""

from __future__ import annotations

from pathlib import Path

import pytest
from model.parallel.parallel_helpers import Greedy, make_nine_head_model, one_process_reference

from strata.model.parallel.shard_loader import PreparedModel, prepare_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nine_head_model(tmp_path_factory.mktemp("nine") / "m")


@pytest.fixture(scope="module")
def prepared(model_dir: Path) -> PreparedModel:
    return prepare_model(model_dir, dtype="float32", cache_dir=None)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[Greedy]:
    return one_process_reference(model_dir)
