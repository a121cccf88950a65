"""`strata status`: the instances in the registry, their states and load, as a table; for a
prefill/decode fleet, then each pool's roles.

A parallel instance (tensor / pipeline parallel) is one row, its layout beside its model
(`tiny@default (tp2)`), followed by one indented line per rank: host, pid, weight and KV bytes.
NODE, last, is the machine each instance runs on (its Ray node's address, else the host name).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

from strata.cluster.local import local_registry_url
from strata.commands.env import CliEnv
from strata.registry import InstanceRecord, create_registry
from strata.registry.instances.records import RankInfo

COLUMNS = ("INSTANCE", "URL", "MODEL", "ROLE", "POOL", "STATE", "RUN/WAIT", "KV", "HEARTBEAT",
           "NODE")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `strata status [--registry URL]`."""
    p = sub.add_parser("status", help="show the instances in the registry, their state and load")
    p.add_argument("--registry", default=None, metavar="URL",
                   help="registry URL (default: $STRATA_REGISTRY, else the SQLite registry of "
                        "`strata up` in the run directory)")


def default_registry_url(env: CliEnv) -> str:
    return env.registry_url or local_registry_url(env.run_dir)


def run(args: argparse.Namespace, env: CliEnv) -> int:
    """Print the table; exit 0 (also when the registry is empty)."""
    url = args.registry or default_registry_url(env)
    records = asyncio.run(_list(url))
    if not records:
        print(f"no instances registered in {url}")
        return 0
    print(format_table(records, now=time.time()))
    if any(r.role.value == "prefill" for r in records):
        print(pools_summary(records))
    return 0


async def _list(url: str) -> list[InstanceRecord]:
    registry = create_registry(url)
    try:
        return await registry.list_instances()
    finally:
        await registry.close()


def _row(record: InstanceRecord, now: float) -> tuple[str, ...]:
    load = record.load
    model = record.model_version + (" (simulated)" if record.simulated else "")
    if record.ranks:
        model += f" ({record.layout})"
    return (record.instance_id, record.url, model, record.role.value, record.pool,
            record.state.value, f"{load.num_running}/{load.num_waiting}",
            f"{load.kv_usage:.0%}", f"{max(0.0, now - record.last_heartbeat):.1f}s ago",
            record.node)


def format_table(records: Sequence[InstanceRecord], *, now: float) -> str:
    """Aligned columns, one line per instance, in the registry's order (by instance id)."""
    rows = [COLUMNS, *(_row(r, now) for r in records)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    for at, record in sorted(enumerate(records, start=1), reverse=True):
        lines[at + 1 : at + 1] = [_rank_line(rank) for rank in record.ranks]
    return "\n".join(lines)


def _rank_line(rank: RankInfo) -> str:
    mib = 1 << 20
    return (f"  rank {rank.rank}  {rank.host} pid {rank.pid}  weights "
            f"{rank.weight_bytes / mib:.1f} MiB  KV {rank.kv_bytes / mib:.1f} MiB")


def pools_summary(records: Sequence[InstanceRecord]) -> str:
    """One line per pool of a prefill/decode fleet: how many of each role, how many ready."""
    counts: dict[str, dict[str, list[int]]] = {}
    for record in records:
        ready_total = counts.setdefault(record.pool, {}).setdefault(record.role.value, [0, 0])
        ready_total[0] += record.state.value == "ready"
        ready_total[1] += 1
    return "\n".join(
        f"pool {pool}: " + ", ".join(f"{total} {role} ({ready} ready)"
                                     for role, (ready, total) in sorted(roles.items()))
        for pool, roles in sorted(counts.items()))


__all__ = ["add_parser", "default_registry_url", "format_table", "pools_summary", "run"]
