"""`strata up --ray --tensor-parallel-size 2 --replicas 2` on a real local Ray, with a real (tiny,
9-head) model: each replica is one placement group of two bundles (its instance actor holds
bundle 0, its second rank is a Ray actor in bundle 1) and registers once, with its layout and
each rank's memory. A rank SIGKILLed mid-stream: the stream ends with an error event and [DONE]
within 2 s, the instance leaves the registry, and Ray restarts the whole instance."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import ray
from model.parallel.parallel_helpers import make_nine_head_model
from ray_cluster import ray_launcher

from strata.cluster.local import LocalClusterConfig, free_port
from strata.cluster.ray_launcher import RayLauncher
from strata.cluster.seed import ClusterSeed
from strata.commands.status import format_table
from strata.registry import InstanceRecord, InstanceState, create_registry
from strata.registry.models import ModelVersion

MODEL = "tiny-nine"
IDS = {f"{MODEL}-v1-0", f"{MODEL}-v1-1"}


def records(url: str) -> dict[str, InstanceRecord]:
    async def go() -> list[InstanceRecord]:
        registry = create_registry(url)
        try:
            return list(await registry.list_instances())
        finally:
            await registry.close()

    return {r.instance_id: r for r in asyncio.run(go())}


def poll(launcher: RayLauncher, predicate: Callable[[], bool], timeout_s: float,
         what: str, interval_s: float = 0.25) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        launcher.poll()
        time.sleep(interval_s)


def ready(url: str) -> dict[str, InstanceRecord]:
    return {i: r for i, r in records(url).items() if r.state == InstanceState.READY}


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayLauncher]:
    root = tmp_path_factory.mktemp("ray-tp2")
    model_dir = make_nine_head_model(root / MODEL)
    cluster = LocalClusterConfig(
        replicas=2, run_dir=root / "run", port=free_port(), stop_timeout_s=10,
        serve_args=("--log-level", "warning", "--tensor-parallel-size", "2", "--dtype",
                    "float32", "--kv-cache-gb", "0.01"),
        reconcile_interval_s=0.25,
    )
    with ray_launcher(cluster, ClusterSeed(ModelVersion(MODEL, "v1", str(model_dir)), 2),
                      tensor_parallel_size=2) as launched:
        yield launched


def test_each_replica_is_one_group_and_registers_once_with_its_layout(
        launcher: RayLauncher) -> None:
    url = launcher.config.cluster.registry_url
    poll(launcher, lambda: set(ready(url)) == IDS, 240, "2 ready instances")
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 2
    for group in groups:
        assert group["strategy"] == "STRICT_PACK"
        assert [b["CPU"] for b in group["bundles"].values()] == [0.25, 0.25]
    found = records(url)
    assert set(found) == IDS  # each instance once: its ranks do not register
    for record in found.values():
        assert record.layout == "tp2"
        assert [r.rank for r in record.ranks] == [0, 1]
        assert all(r.weight_bytes > 0 and r.kv_bytes > 0 for r in record.ranks)
        assert record.ranks[0].pid != record.ranks[1].pid
    table = format_table(list(found.values()), now=time.time()).splitlines()
    assert len(table) == 1 + 2 * 3  # header, then each instance and its two ranks
    assert all("(tp2)" in table[i] for i in (1, 4))


def stream_tokens(base: str, on_first: Callable[[], Any]) -> tuple[list[str], float]:
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 100,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    on_first()
    return events, time.monotonic()


def test_a_rank_killed_mid_stream_restarts_the_whole_instance(launcher: RayLauncher) -> None:
    url = launcher.config.cluster.registry_url
    poll(launcher, lambda: set(ready(url)) == IDS, 240, "2 ready instances")
    victim = f"{MODEL}-v1-0"
    before = records(url)[victim]
    killed: list[float] = []

    def kill_rank_1() -> None:
        os.kill(before.ranks[1].pid, signal.SIGKILL)
        killed.append(time.monotonic())

    events, ended_at = stream_tokens(before.url, kill_rank_1)
    assert events[-1] == "[DONE]"
    error_event, last = json.loads(events[-2]), json.loads(events[-3])
    assert "error" in error_event, events[-4:]  # the finish chunk, an error event, [DONE]
    assert last["choices"][0]["finish_reason"] == "error", events[-4:]
    assert 3 < len(events) < 100 and ended_at - killed[0] < 2.0
    poll(launcher, lambda: victim not in records(url), 30, "the instance to deregister", 0.05)
    poll(launcher, lambda: victim in ready(url), 240, "the instance's restart")
    after = records(url)[victim]
    assert after.url == before.url  # the same actor, restarted in place
    assert after.ranks[0].pid != before.ranks[0].pid
    assert after.ranks[1].pid != before.ranks[1].pid
    reply = httpx.post(f"{after.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert set(ready(url)) == IDS
