"""Shared by the registry tests: `story` (an async test body on one registry of
any kind), the ModelRegistry `make` fixture (one shared backend per test: memory, a SQLite temp
file or a real Redis) and records to store.

    from model_registries import Make, make_fixture, story  # make_fixture: noqa F401
    from redis_server import redis_server, redis_url  # noqa: F401   (make needs them)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import redis

from strata.clock import ManualClock
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
    Strategy,
    create_model_registry,
)

BACKENDS = ["memory", "sqlite", "redis"]


class Closable(Protocol):
    async def close(self) -> None: ...


R = TypeVar("R", bound=Closable)
Make = Callable[[ManualClock], ModelRegistry]


@pytest.fixture(name="make", params=BACKENDS)
def make_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A factory of registries on ONE shared backend (same object / file / server)."""
    if request.param == "memory":
        shared = create_model_registry("memory://")
        yield lambda clock: with_clock(shared, clock)
        return
    url = backend_url(request.param, request, tmp_path)
    yield lambda clock: create_model_registry(url, clock=clock)


def backend_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty `backend` ("sqlite" or "redis") for this test."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    url: str = request.getfixturevalue("redis_url")
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


def with_clock(registry: R, clock: ManualClock) -> R:
    """A shared in-memory registry, read through this caller's clock from now on."""
    registry.clock = clock  # type: ignore[attr-defined]
    return registry


def story(make: Callable[[ManualClock], R],
          body: Callable[[R, ManualClock], Awaitable[None]]) -> None:
    async def main() -> None:
        clock = ManualClock(1000.0)
        registry = make(clock)
        try:
            await body(registry, clock)
        finally:
            await registry.close()

    asyncio.run(main())


def release(release_id: str = "r-1", name: str = "chat", **kw: Any) -> Release:
    return Release(release_id=release_id, name=name, to_version="v2", from_version="v1", **kw)


def full_records() -> tuple[ModelVersion, ModelRouting, Deployment, Release]:
    return (ModelVersion("chat", "v2", "file:///m/2", "12" * 32, ("--a", "b"), 7.25),
            ModelRouting("chat", "v2", "v1", "v3", 0.125),
            Deployment("chat", "v3", 4, DeploymentState.RETIRING),
            Release("r-9", "chat", "v3", None, Strategy.CANARY, 0.2, 3, ReleaseState.CANARY,
                    "watching", (("pending", 1.5), ("canary", 2.75)), "ctl-1", 99.5,
                    created_at=1.25, stats={"ready_to_flip_s": 0.5}))
