"""Strata on a real Ray cluster of several nodes on one machine (tests/ray_cluster.py: a head
on 127.0.0.1 with no CPUs, two worker nodes on 127.0.0.2 and 127.0.0.3 with one CPU each, one
cluster for the module): node identities and addresses differ, and everything stays on the
loopback.

- `strata up --ray --address ...` with a Redis registry spreads its replicas over both
  workers; each instance listens on, and registers, its own node's address (URL and node).
- A pipeline-parallel instance whose two stages land on two nodes talks through gloo (the
  nodes are two hosts by their node ids, whatever their addresses) and answers greedily what
  one process answers; the rank on the other node gets the weights through the model store
  into its node cache.
- A worker node lost (killed, not drained) under load: no request fails (the gateway retries
  before the first byte), a stream running on the lost node is resumed on the other worker and
  ends whole, and Ray brings the lost instance back on the remaining worker, where it registers
  that node's address. Runs last: it takes a node out of the module's cluster.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from model.parallel.parallel_helpers import (
    Greedy,
    assert_same,
    make_engine,
    make_nine_head_model,
    one_process_reference,
    prompts,
    run_greedy,
)
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray_cluster import NODE_LOSS_SEEN_FAST, fake_nodes, node_address, ray_launcher
from redis_server import redis_server, redis_url  # noqa: F401

from strata.cluster.local import LocalClusterConfig, free_port
from strata.cluster.ray_launcher import RayLauncher
from strata.cluster.ray_node import Node
from strata.cluster.ray_ranks import RayPlacement, RayRankLauncher
from strata.cluster.seed import ClusterSeed
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import prepare_model
from strata.model.parallel.weight_source import NODE_LOCKS
from strata.registry import InstanceRecord, InstanceState, create_registry
from strata.registry.models import ModelVersion
from strata.store import write_manifest

WORKERS = {node_address(1), node_address(2)}
SIM = ModelVersion("smol", "v1", "sim:smollm2-cpu")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with fake_nodes(1, 1, head_cpus=0, system_config=NODE_LOSS_SEEN_FAST) as nodes:
        yield nodes


def records(url: str) -> list[InstanceRecord]:
    async def go() -> list[InstanceRecord]:
        registry = create_registry(url)
        try:
            return list(await registry.list_instances())
        finally:
            await registry.close()

    return asyncio.run(go())


def test_the_nodes_have_their_own_loopback_addresses(cluster: Cluster) -> None:
    rows = [Node.of(row) for row in ray.nodes() if row["Alive"]]
    assert sorted(n.address for n in rows) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert len({n.id for n in rows}) == 3
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def sim_config(tmp_path: Path, registry: str) -> LocalClusterConfig:
    return LocalClusterConfig(replicas=2, run_dir=tmp_path / "run", port=free_port(),
                              stop_timeout_s=10, serve_args=("--log-level", "warning"),
                              reconcile_interval_s=0.25, registry=registry)


def wait_ready(launcher: RayLauncher, registry_url: str, timeout_s: float,
               on: set[str] | None = None) -> list[InstanceRecord]:
    """Poll the launcher until both instances are READY (on the nodes at `on`, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = [r for r in records(registry_url) if r.state == InstanceState.READY]
        if len(ready) == 2 and (on is None or {host_of(r.url) for r in ready} <= on):
            return ready
        launcher.poll()
        time.sleep(0.25)
    raise AssertionError(f"not 2 ready instances on {on} within {timeout_s} s: "
                         f"{records(registry_url)}")


def host_of(url: str) -> str:
    return url.removeprefix("http://").rsplit(":", 1)[0]


def wait_routed(gateway: str, num: int, timeout_s: float = 60) -> None:
    """Until the gateway routes to `num` instances (the registry lists them a moment before the
    gateway's next poll sees them: a request in between is a 404 for an unknown model)."""
    def routed() -> int:
        try:
            views = httpx.get(f"{gateway}/admin/instances", timeout=5).json()["instances"]
        except (httpx.HTTPError, ValueError, KeyError):
            return 0
        return sum(1 for v in views if v["routable"])

    deadline = time.monotonic() + timeout_s
    while routed() < num:
        assert time.monotonic() < deadline, f"the gateway routes to fewer than {num} instances"
        time.sleep(0.1)


def complete(gateway: str) -> int:
    reply = httpx.post(f"{gateway}/v1/completions", timeout=60,
                       json={"model": "smol", "prompt": "hello", "max_tokens": 3})
    return reply.status_code


@dataclass
class Stream:
    """A long completion streamed in a thread: where it ran first, and how it ended."""

    thread: threading.Thread = field(default_factory=threading.Thread)
    started: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    instance: str = ""
    errors: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False

    def read(self, gateway: str) -> None:
        body = {"model": "smol", "prompt": "tell me a long story", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{gateway}/v1/completions", json=body,
                              timeout=120) as reply:
                self.status, self.instance = reply.status_code, reply.headers.get(
                    "x-strata-instance", "")
                self.started.set()
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors.append(event["error"])
                        for choice in event.get("choices", []):
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        finally:
            self.started.set()


def streams_until_one_on(gateway: str, host: str, registry_url: str) -> list[Stream]:
    """Streams started one at a time until one runs on an instance at `host` (the gateway
    places them; all go on to their end)."""
    streams: list[Stream] = []
    for _ in range(8):
        stream = Stream()
        stream.thread = threading.Thread(target=stream.read, args=(gateway,), daemon=True)
        stream.thread.start()
        assert stream.started.wait(30) and stream.status == 200, stream.status
        streams.append(stream)
        on = {r.instance_id: host_of(r.url) for r in records(registry_url)}
        if on.get(stream.instance) == host:
            return streams
    raise AssertionError(f"no stream of {len(streams)} went to an instance on {host}")


def gateway_metric(gateway: str, name: str) -> float:
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def launched(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory,
             redis_url: str) -> Iterator[RayLauncher]:  # noqa: F811
    """`strata up --ray --address ...` with two simulated replicas, one for the module: the
    spread test reads it as started, the node-loss test (the last) takes a node from under it."""
    config = sim_config(tmp_path_factory.mktemp("ray-sim"), redis_url)
    address = ray.get_runtime_context().gcs_address
    with ray_launcher(config, ClusterSeed(SIM, replicas=2), address=address) as running:
        yield running


def gateway_of(launcher: RayLauncher) -> str:
    config = launcher.config.cluster
    return f"http://{config.host}:{config.port}"


def test_replicas_spread_over_both_workers_and_register_their_nodes_addresses(
        launched: RayLauncher, redis_url: str) -> None:  # noqa: F811
    nodes = ray.get([a.node.remote() for a in launched.actors])
    assert {n.address for n in nodes} == WORKERS  # one replica on each worker
    ready = wait_ready(launched, redis_url, 120)
    assert {host_of(r.url) for r in ready} == WORKERS
    assert {r.node for r in ready} == WORKERS  # what `strata status` shows as NODE
    wait_routed(gateway_of(launched), 2)
    assert complete(gateway_of(launched)) == 200


@pytest.fixture(scope="module")
def nine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nine_head_model(tmp_path_factory.mktemp("nine") / "m")


@pytest.fixture(scope="module")
def reference(nine: Path) -> list[Greedy]:
    return one_process_reference(nine)


def test_two_stages_on_two_nodes_talk_gloo_and_answer_what_one_process_answers(
        cluster: Cluster, nine: Path, reference: list[Greedy], tmp_path: Path) -> None:
    """Rank 0 is this process, on the head; rank 1 must go to another node (STRICT_SPREAD),
    where it resolves the model through the store into the node cache (verified against the
    manifest there, leaving the node's marker) instead of opening rank 0's files."""
    group = placement_group([{f"node:{node_address(0)}": 0.001}, {"CPU": 0.5}],
                            strategy="STRICT_SPREAD")
    write_manifest(nine)
    cache = tmp_path / "node-cache"
    prepared = prepare_model(nine, dtype="float32", cache_dir=cache)
    launcher = RayRankLauncher(RayPlacement(placement_group=group.id.hex()))
    executor = ParallelExecutor(prepared, ParallelLayout(1, 2), dtype="float32", timeout_s=60,
                                launcher=launcher)
    try:
        spec = executor.comm_spec
        assert (spec.world_backend, spec.tp_backend) == ("gloo", "shm")
        assert spec.init_method is not None
        assert spec.init_method.startswith(f"tcp://{node_address(0)}:")
        assert len(set(spec.hosts)) == 2
        got = run_greedy(make_engine(executor, prepared.config.vocab_size), prompts())
    finally:
        executor.shutdown()
        remove_placement_group(group)
    assert_same(got, reference)
    assert len(list((cache / NODE_LOCKS).glob("*.verified"))) == 1  # rank 1's node verified


def test_a_worker_node_lost_under_load_fails_nothing_and_its_instance_returns_elsewhere(
        cluster: Cluster, launched: RayLauncher, redis_url: str) -> None:  # noqa: F811
    gateway = gateway_of(launched)
    wait_ready(launched, redis_url, 120)
    wait_routed(gateway, 2)
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set() and len(statuses) < 2000:
            statuses.append(complete(gateway))

    loader = threading.Thread(target=load)
    loader.start()
    streams = []
    try:
        while len(statuses) < 10:
            time.sleep(0.05)
        streams = streams_until_one_on(gateway, node_address(2), redis_url)
        lost = next(n for n in cluster.worker_nodes if n.node_ip_address == node_address(2))
        lost_at = time.monotonic()
        cluster.remove_node(lost, allow_graceful=False)
        ready = wait_ready(launched, redis_url, 180, on={node_address(1)})
        recovery_s = time.monotonic() - lost_at
        served_before = len(statuses)
        while len(statuses) < served_before + 10:
            time.sleep(0.05)
    finally:
        stop.set()
        loader.join(60)
        for stream in streams:
            stream.thread.join(120)
    assert {host_of(r.url) for r in ready} == {node_address(1)}
    assert [s for s in statuses if s != 200] == [], "a request failed"
    # every stream ran whole, the one on the lost node resumed on the other worker
    assert [(s.status, s.errors, s.finish_reason, s.done) for s in streams] == [
        (200, [], "length", True)] * len(streams)
    assert gateway_metric(gateway, "strata:gateway_stream_resumes_total") >= 1
    print(f"node lost: both instances ready on the other worker after {recovery_s:.1f} s; "
          f"{len(statuses)} requests, all 200; {len(streams)} streams whole, "
          f"one resumed from the lost node")
