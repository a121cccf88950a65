"""`strata status` over a SQLite registry in a temp directory."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

from strata.commands import status, up
from strata.commands.env import CliEnv
from strata.registry import InstanceLoad, InstanceRecord, InstanceState, Role, create_registry
from strata.registry.instances.records import RankInfo


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="strata")
    status.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


async def _fill(url: str) -> None:
    long_ago = create_registry(url, clock=lambda: time.time() - 60)
    await long_ago.register(InstanceRecord("i-dead", "http://127.0.0.1:8002", "tiny",
                                           state=InstanceState.READY))
    await long_ago.close()
    registry = create_registry(url)
    await registry.register(InstanceRecord(
        "i-live", "http://127.0.0.1:8001", "tiny", version="v2", role=Role.DECODE, pool="gpu",
        state=InstanceState.READY, simulated=True,
        load=InstanceLoad(num_running=3, num_waiting=1, kv_usage=0.25)))
    await registry.close()


def test_status_lists_instances_of_the_run_dir_registry(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run")
    asyncio.run(_fill(status.default_registry_url(env)))
    assert status.run(parse(["status"]), env) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["INSTANCE", "URL", "MODEL", "ROLE", "POOL", "STATE", "RUN/WAIT",
                                "KV", "HEARTBEAT", "NODE"]
    assert lines[1].split()[:7] == ["i-dead", "http://127.0.0.1:8002", "tiny@default", "mixed",
                                    "default", "dead", "0/0"]
    assert lines[2].split()[:9] == ["i-live", "http://127.0.0.1:8001", "tiny@v2", "(simulated)",
                                    "decode", "gpu", "ready", "3/1", "25%"]
    assert lines[1].split()[-2].startswith("6") and lines[1].endswith("s ago")  # about 60 s
    assert len(lines) == 3


def test_status_flag_and_env_choose_the_registry(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run", registry_url=url)
    assert status.default_registry_url(env) == url
    assert status.run(parse(["status", "--registry", "memory://"]), env) == 0
    assert capsys.readouterr().out == "no instances registered in memory://\n"


@pytest.mark.parametrize("registry_env", [None, "redis://127.0.0.1:6390/0"])
def test_status_reads_the_registry_strata_up_uses(tmp_path: Path,
                                                  registry_env: str | None) -> None:
    """Same run dir and STRATA_REGISTRY: `strata status` lists what `strata up` started."""
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run", registry_url=registry_env)
    parser = argparse.ArgumentParser(prog="strata")
    up.add_parser(parser.add_subparsers(dest="command"))
    config = up._config(parser.parse_args(["up", "--simulate", "smollm2-cpu"]), env)
    expected = registry_env or f"sqlite:///{(tmp_path / 'run').resolve() / 'registry.db'}"
    assert config.registry_url == status.default_registry_url(env) == expected


def test_format_table_aligns_columns_and_names_each_instances_node() -> None:
    record = InstanceRecord("a", "http://h:1", "m", last_heartbeat=100.0,
                            load=InstanceLoad(kv_usage=0.5), node="10.0.0.2")
    assert InstanceRecord.from_json(record.to_json()) == record  # through every backend
    assert status.format_table([record], now=101.25).splitlines() == [
        "INSTANCE  URL         MODEL      ROLE   POOL     STATE     RUN/WAIT  KV   HEARTBEAT  NODE",
        "a         http://h:1  m@default  mixed  default  starting  0/0       50%  1.2s ago   "
        "10.0.0.2",
    ]


def test_a_parallel_instance_is_one_row_with_its_layout_and_a_line_per_rank() -> None:
    mib = 1 << 20
    ranks = (RankInfo(0, "node-a", 101, 70 * mib, 8 * mib),
             RankInfo(1, "node-a", 102, 66 * mib + mib // 2, 8 * mib))
    parallel = InstanceRecord("a-0", "http://h:1", "m", last_heartbeat=100.0, layout="tp2",
                              ranks=ranks)
    assert InstanceRecord.from_json(parallel.to_json()) == parallel  # through every backend
    single = InstanceRecord("b-0", "http://h:2", "m", last_heartbeat=100.0)
    lines = status.format_table([parallel, single], now=101.0).splitlines()
    assert lines[1].split()[:4] == ["a-0", "http://h:1", "m@default", "(tp2)"]
    assert lines[2:4] == ["  rank 0  node-a pid 101  weights 70.0 MiB  KV 8.0 MiB",
                          "  rank 1  node-a pid 102  weights 66.5 MiB  KV 8.0 MiB"]
    assert lines[4].split()[:3] == ["b-0", "http://h:2", "m@default"]
    assert len(lines) == 5
