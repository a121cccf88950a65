"""Fixtures: a moto S3 server per test module, a tiny model directory per session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from s3_server import DUMMY, CountingMotoServer  # noqa: E402
from tiny_models import make_tiny_model_dir  # noqa: E402

from strata.store import S3Config  # noqa: E402
from strata.store.s3 import make_client  # noqa: E402


@pytest.fixture(scope="module")
def s3_server() -> Iterator[CountingMotoServer]:
    server = CountingMotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: CountingMotoServer, request: pytest.FixtureRequest) -> S3Config:
    """Dummy credentials and a fresh bucket named after the test."""
    config = S3Config(s3_server.url, DUMMY.region_name, DUMMY.access_key_id,
                      DUMMY.secret_access_key)
    make_client(config).create_bucket(Bucket=_bucket(request.node.name))
    return config


def _bucket(test_name: str) -> str:
    return test_name.replace("_", "-").lower()[:50]


@pytest.fixture
def bucket(request: pytest.FixtureRequest) -> str:
    return _bucket(request.node.name)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("store") / "tiny")
