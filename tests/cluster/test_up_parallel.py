"""`strata up --tensor-parallel-size 2` (the local supervisor) with a real tiny model: the
instance serves through the gateway, registers once with its layout and its ranks (what
`strata status` prints), and when one of its ranks dies the instance exits, leaves the registry
and the supervisor restarts it whole."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_process import Cluster, start_cluster, wait_until
from model.parallel.parallel_helpers import make_nine_head_model, rank_processes

from strata.cluster.local import local_registry_url
from strata.commands.status import format_table
from strata.registry import InstanceRecord, InstanceState, create_registry

INSTANCE = "tiny-nine-default-0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("up-tp2")
    model_dir = make_nine_head_model(root / "tiny-nine")
    started = start_cluster([str(model_dir), "--tensor-parallel-size", "2", "--dtype", "float32",
                             "--kv-cache-gb", "0.01"], root, replicas=1)
    yield started
    started.stop()


def test_up_passes_the_layout_to_every_instance_and_shares_its_threads_over_the_ranks(
        tmp_path: Path) -> None:
    from strata.cli import build_parser
    from strata.commands.env import CliEnv
    from strata.commands.up import _config

    args = build_parser().parse_args(["up", str(tmp_path / "m"), "-tp", "2", "-pp", "2",
                                      "--pipeline-layers", "12,18",
                                      "--threads-per-instance", "8"])
    config = _config(args, CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run"))
    flags = config.serve_args
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert flags[flags.index("--pipeline-parallel-size") + 1] == "2"
    assert flags[flags.index("--pipeline-layers") + 1] == "12,18"
    assert config.threads_per_instance == 2  # `strata serve --threads` is per rank: 8 / 4


def records(cluster: Cluster) -> dict[str, InstanceRecord]:
    async def go() -> list[InstanceRecord]:
        registry = create_registry(local_registry_url(cluster.run_dir))
        try:
            return list(await registry.list_instances())
        finally:
            await registry.close()

    return {r.instance_id: r for r in asyncio.run(go())}


def is_ready(cluster: Cluster) -> bool:
    record = records(cluster).get(INSTANCE)
    return record is not None and record.state == InstanceState.READY


def test_the_instance_registers_once_with_its_layout_and_ranks(cluster: Cluster) -> None:
    reply = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                       json={"model": "tiny-nine", "prompt": "hello", "max_tokens": 5})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
    (record,) = records(cluster).values()
    assert record.layout == "tp2"
    serve_pid = cluster.pids()[INSTANCE]
    assert [r.pid for r in record.ranks] == [serve_pid, *rank_processes(serve_pid)]
    assert all(r.weight_bytes > 0 and r.kv_bytes > 0 for r in record.ranks)
    lines = format_table([record], now=record.last_heartbeat).splitlines()
    assert "tiny-nine@default (tp2)" in lines[1]
    assert lines[2].startswith("  rank 0  ") and lines[3].startswith("  rank 1  ")


def test_a_dead_rank_restarts_the_whole_instance(cluster: Cluster) -> None:
    wait_until(lambda: is_ready(cluster), 120, "the instance ready")
    serve_pid = cluster.pids()[INSTANCE]
    (rank_1,) = rank_processes(serve_pid)
    os.kill(rank_1, signal.SIGKILL)
    wait_until(lambda: INSTANCE not in records(cluster), 30, "the instance to deregister")
    wait_until(lambda: cluster.pids().get(INSTANCE, serve_pid) != serve_pid
               and is_ready(cluster), 240, "the supervisor's restart")
    assert not Path(f"/proc/{serve_pid}").exists()
    new_pid = cluster.pids()[INSTANCE]
    assert [r.pid for r in records(cluster)[INSTANCE].ranks] == [new_pid,
                                                                 *rank_processes(new_pid)]
    wait_until(lambda: routable(cluster), 30, "the gateway to route to it again")
    reply = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                       json={"model": "tiny-nine", "prompt": "hello", "max_tokens": 5})
    assert reply.status_code == 200


def routable(cluster: Cluster) -> bool:
    reply = httpx.get(f"{cluster.url}/ready", timeout=5)
    return reply.status_code == 200 and reply.json()["num_routable"] >= 1
