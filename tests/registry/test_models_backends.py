"""The ModelRegistry backends beyond the shared contract: the factory, writers in separate
processes, SQLite sharing the instance registry's file, Redis failures."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import pytest
from model_registries import backend_url, full_records
from redis_server import free_port, redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, RegistryError
from strata.registry import InstanceRecord, create_registry
from strata.registry.models import Deployment, ModelRouting, ModelVersion, create_model_registry


def test_memory_urls_give_fresh_registries_and_bad_urls_say_what_to_use() -> None:
    async def main() -> None:
        a, b = create_model_registry("memory://"), create_model_registry("memory://")
        await a.add_version(ModelVersion("chat", "v1", "/m/1"))
        assert await b.list_versions() == []

    asyncio.run(main())
    with pytest.raises(ConfigError, match="use one of: memory://, sqlite:///PATH, redis://"):
        create_model_registry("etcd://127.0.0.1")
    with pytest.raises(ConfigError, match="needs an absolute path"):
        create_model_registry("sqlite://relative.db")


# --- many processes ---------------------------------------------------------------------------

_INCREMENTS = """
import asyncio, sys
from strata.registry.models import create_model_registry
from strata.registry.models import Deployment
from strata.errors import ConflictError

async def main(url: str, count: int) -> None:
    reg = create_model_registry(url)
    retries = 0
    for _ in range(count):
        while True:
            d = next(x for x in await reg.list_deployments() if x.key == "chat@v1")
            try:
                await reg.put_deployment(Deployment(d.name, d.version, d.replicas + 1),
                                         expected_revision=d.revision)
                break
            except ConflictError:
                retries += 1
    await reg.close()
    print(retries)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_two_processes_incrementing_by_cas_lose_no_update(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url = backend_url(backend, request, tmp_path)

    async def main() -> None:
        reg = create_model_registry(url)
        await reg.put_deployment(Deployment("chat", "v1", 0), expected_revision=0)
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-c", _INCREMENTS, url, "100", stdout=asyncio.subprocess.PIPE)
            for _ in range(2)]
        outputs = [await p.communicate() for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        (final,) = await reg.list_deployments()
        assert (final.replicas, final.revision) == (200, 201)  # every increment landed once
        await reg.close()

    asyncio.run(main())


def test_sqlite_shares_the_instance_registry_file_and_stores_json(tmp_path: Path) -> None:
    path = tmp_path / "registry.db"

    async def main() -> None:
        instances = create_registry(f"sqlite:///{path}")
        models = create_model_registry(f"sqlite:///{path}", clock=ManualClock(1000.0))
        try:
            await instances.register(InstanceRecord("i-1", "http://127.0.0.1:9", "chat"))
            stored = await models.put_release(full_records()[3], expected_revision=0)
            assert [r.instance_id for r in await instances.list_instances()] == ["i-1"]
        finally:
            await instances.close()
            await models.close()
        with closing(sqlite3.connect(path)) as conn:
            (text,) = conn.execute("SELECT record FROM releases").fetchone()
        assert json.loads(text) == stored.to_json()

    asyncio.run(main())


def test_redis_failures_are_registry_errors_naming_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def main() -> None:
        reg = create_model_registry(url)
        try:
            with pytest.raises(RegistryError, match=f"redis model registry {url}"):
                await reg.set_routing(ModelRouting("chat", live="v1"), expected_revision=0)
            with pytest.raises(RegistryError, match=f"redis model registry {url}"):
                await reg.list_versions()
        finally:
            await reg.close()

    asyncio.run(main())
