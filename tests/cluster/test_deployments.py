"""The supervisor reconciles real `strata serve --simulate` instances toward the deployments in a
SQLite registry: a new version starts, a retiring one drains (in-flight requests finish, the
process exits 0, nothing restarts it) and its record goes, a crash is still restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from strata.cluster.local import LocalClusterConfig, Supervisor, free_port
from strata.cluster.seed import ClusterSeed, seed_registry
from strata.registry import InstanceRecord, InstanceState, create_registry
from strata.registry.models import Deployment, DeploymentState, ModelVersion, create_model_registry

T = TypeVar("T")
V1 = ModelVersion("smol", "v1", "sim:smollm2-cpu")
V2 = ModelVersion("smol", "v2", "sim:smollm2-cpu")


def registry_call(url: str, use: Callable[[Any, Any], Coroutine[Any, Any, T]]) -> T:
    """`use(models, instances)` on fresh clients of the registry at `url` (another process's
    view, like the controller's)."""
    async def go() -> T:
        models, instances = create_model_registry(url), create_registry(url)
        try:
            return await use(models, instances)
        finally:
            await models.close()
            await instances.close()

    return asyncio.run(go())


def ready(url: str) -> dict[str, InstanceRecord]:
    async def use(_: Any, instances: Any) -> dict[str, InstanceRecord]:
        return {r.instance_id: r for r in await instances.list_instances()
                if r.state == InstanceState.READY}

    return registry_call(url, use)


def wait_polling(sup: Supervisor, predicate: Callable[[], bool], timeout_s: float,
                 what: str) -> None:
    """Run supervision rounds until `predicate` holds (bounded)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        sup.poll()
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Supervisor]:
    config = LocalClusterConfig(replicas=2, run_dir=tmp_path, port=free_port(),
                                serve_args=("--log-level", "warning"), restart_backoff_s=0.5,
                                stop_timeout_s=20.0, reconcile_interval_s=0.2)

    async def seed(models: Any, instances: Any) -> Any:
        return await seed_registry(models, instances, ClusterSeed(V1, replicas=2))

    registry_call(config.registry_url, seed)
    sup = Supervisor(config)
    sup.start()
    yield sup
    sup.stop()


def put_deployment(url: str, deployment: Deployment) -> None:
    async def use(models: Any, _: Any) -> None:
        if deployment.version == "v2":
            await models.add_version(V2)
        current = {d.key: d for d in await models.list_deployments()}.get(deployment.key)
        await models.put_deployment(deployment,
                                    expected_revision=current.revision if current else 0)

    registry_call(url, use)


def stream_tokens(url: str, max_tokens: int, out: dict[str, Any]) -> None:
    """A streaming completion; records its finish reason and the version that answered."""
    body = {"model": "smol", "prompt": "tell me a story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
        out["version"] = resp.headers["x-model-version"]
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                out["started"] = True
                reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                out["finish_reason"] = reason or out.get("finish_reason")


def test_a_new_version_starts_the_old_one_drains_and_a_crash_still_restarts(
    cluster: Supervisor,
) -> None:
    url = cluster.config.registry_url
    wait_polling(cluster, lambda: set(ready(url)) == {"smol-v1-0", "smol-v1-1"}, 60, "2 v1")

    put_deployment(url, Deployment("smol", "v2", 1))
    wait_polling(cluster, lambda: "smol-v2-0" in ready(url), 60, "a ready v2 instance")
    v2 = ready(url)["smol-v2-0"]
    assert v2.version == "v2"
    resp = httpx.post(f"{v2.url}/v1/completions", timeout=30,
                      json={"model": "smol", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-model-version"] == "smol@v2"

    v1_procs = {iid: cluster.instances[iid].proc for iid in ("smol-v1-0", "smol-v1-1")}
    in_flight: dict[str, Any] = {}
    streamer = threading.Thread(target=stream_tokens,
                                args=(ready(url)["smol-v1-0"].url, 150, in_flight))
    streamer.start()
    wait_polling(cluster, lambda: in_flight.get("started", False), 10, "the stream to flow")
    put_deployment(url, Deployment("smol", "v1", 2, DeploymentState.RETIRING))
    wait_polling(cluster, lambda: not any(i.startswith("smol-v1") for i in cluster.instances),
                 60, "the v1 instances to drain and exit")
    streamer.join(timeout=30)
    assert in_flight == {"version": "smol@v1", "started": True, "finish_reason": "length"}
    assert {iid: p.returncode for iid, p in v1_procs.items() if p is not None} == {
        "smol-v1-0": 0, "smol-v1-1": 0}, "drained and exited cleanly, not killed"

    async def deployments(models: Any, _: Any) -> list[str]:
        return [d.key for d in await models.list_deployments()]

    wait_polling(cluster, lambda: registry_call(url, deployments) == ["smol@v2"], 10,
                 "the v1 deployment record deleted")
    for _ in range(5):  # a few more rounds: nothing brings v1 back
        cluster.poll()
    assert list(cluster.instances) == ["smol-v2-0"]
    assert set(ready(url)) == {"smol-v2-0"}

    v2_proc = cluster.instances["smol-v2-0"].proc
    assert v2_proc is not None
    os.kill(v2_proc.pid, signal.SIGKILL)
    wait_polling(cluster, lambda: cluster.instances["smol-v2-0"].num_restarts == 1, 30,
                 "the crashed v2 instance restarted")
    wait_polling(cluster, lambda: "smol-v2-0" in ready(url), 60, "v2 ready again")
    assert cluster.instances["smol-v2-0"].proc is not v2_proc
