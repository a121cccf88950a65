"""Fault scenarios over real processes, for tests/chaos (short) and bench/chaos.py (long).

Each scenario starts its cluster in `place.root`, runs `ChaosLoad` (tests/harness/chaos_load.py)
through the gateway for `timing.before_s`, injects its fault for `timing.fault_s`, lets the
cluster recover for `timing.after_s`, stops the load, checks every acknowledged session turn
against the session store and returns a `FaultReport`:

    redis_kill        the Redis of sessions and pins SIGKILLed, restarted (same port, AOF)
    registry_outage   the Redis registry SIGKILLed and restarted after the fault
    instance_freeze   an instance SIGSTOPped, then SIGCONTed
    network_faults    latency, then connection resets, on TCP proxies between gateway and
                      instances (tests/harness/tcp_proxy.py)
    gateway_restart   the gateway SIGKILLed; `strata up` restarts it

Instances are simulated (`strata serve --simulate`) with a 20 ms decode step.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.chaos_load import ChaosLoad, LoadResult, check_sessions, gateway_counter
from harness.procs import Proc, start_up, wait_until
from strata.sim.profile import LatencyProfile

MODEL = "sim-chaos"
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.05, decode_ms_base=20.0, decode_ms_per_seq=0.2)
RESUMED = ("strata:gateway_stream_resumes_total", 'outcome="resumed"')


@dataclass(frozen=True, slots=True)
class Timing:
    before_s: float = 3.0
    fault_s: float = 3.0
    after_s: float = 4.0


@dataclass(frozen=True, slots=True)
class LoadSize:
    num_conversations: int = 4
    num_streams: int = 4
    max_tokens: int = 24


@dataclass(slots=True)
class FaultReport:
    """What one fault cost (`recovery_s`: from the fault to the end of the last request that
    failed after it; `max_stream_gap_s`: the longest pause inside a stream that succeeded)."""

    fault: str
    command: str
    load_s: float
    sent: int
    failed: int
    resumed: int
    turns_acked: int
    turns_lost: int
    turns_duplicated: int
    recovery_s: float
    max_stream_gap_s: float
    errors: list[str] = field(default_factory=list)  # a few distinct failure messages
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def row(self) -> str:
        return (f"| {self.fault} | {self.sent} | {self.failed} | {self.resumed} | "
                f"{self.turns_acked} | {self.turns_lost} | {self.turns_duplicated} | "
                f"{self.recovery_s:.2f} | {self.max_stream_gap_s:.2f} |")


def report(fault: str, command: str, url: str, load: ChaosLoad, result: LoadResult,
           fault_at: float, resumed: float, extra: dict[str, Any] | None = None) -> FaultReport:
    sessions = check_sessions(url, result)
    distinct = sorted({o.error[:160] for o in result.failures})
    in_flight = [o for o in result.failures if o.started_at < fault_at <= o.ended_at]
    by_kind: dict[str, int] = {}
    for outcome in result.failures:
        kind = f"{outcome.kind} (streamed)" if outcome.is_stream else outcome.kind
        by_kind[kind] = by_kind.get(kind, 0) + 1
    started = min((o.started_at for o in result.outcomes), default=fault_at)
    return FaultReport(fault, command, round(time.monotonic() - started, 1), result.num_sent,
                       len(result.failures), int(resumed), result.num_turns_acked,
                       sessions.num_lost, sessions.num_duplicated,
                       round(result.recovery_s(fault_at), 3),
                       round(result.max_gap_s(fault_at), 3), distinct[:5],
                       {"failed_in_flight_at_fault": len(in_flight), "failed_by_kind": by_kind,
                        **(extra or {})})


def run_with_load(url: str, size: LoadSize, timing: Timing, inject: Callable[[], None],
                  restore: Callable[[], None]) -> tuple[ChaosLoad, LoadResult, float]:
    """Load, fault (inject, wait fault_s, restore), recovery; returns the fault's time."""
    load = ChaosLoad(url, MODEL, num_conversations=size.num_conversations,
                     num_streams=size.num_streams, max_tokens=size.max_tokens).start()
    time.sleep(timing.before_s)
    fault_at = time.monotonic()
    try:
        inject()
        time.sleep(timing.fault_s)
    finally:
        restore()
    time.sleep(timing.after_s)
    return load, load.stop(), fault_at


def up_args(root: Path, replicas: int, extra: Sequence[str] = ()) -> list[str]:
    PROFILE.save(root / "profile.json")
    return ["--replicas", str(replicas), "--simulate", str(root / "profile.json"),
            "--served-model-name", MODEL, "--log-level", "warning", *extra]


@dataclass(frozen=True, slots=True)
class Place:
    """Where a scenario runs: its directory, the environment its processes start from (the
    caller's: only strata/cli.py reads the environment in strata/), a redis-server binary."""

    root: Path
    env: Mapping[str, str]
    redis_binary: Path | None = None


def start_cluster(place: Place, args: list[str], python: str = sys.executable) -> Proc:
    run_dir = place.root / "run"
    env = {**place.env, "STRATA_RUN_DIR": str(run_dir)}
    return start_up(args, run_dir, env=env, python=python, timeout_s=120)


def stop_cluster(up: Proc) -> None:
    up.stop(timeout_s=60, sig=signal.SIGINT)


def pids(root: Path) -> dict[str, int]:
    lines = (root / "run" / "pids").read_text().split("\n")
    return {name: int(pid) for name, pid in (line.split() for line in lines if line)}


def command_line(args: Sequence[str]) -> str:
    return "strata up " + " ".join(a if " " not in a else repr(a) for a in args)


def resumed_since(url: str, before: float) -> float:
    return max(gateway_counter(url, *RESUMED) - before, 0.0)


def wait_for_instances(url: str, num: int, timeout_s: float = 60.0) -> None:
    import httpx

    from harness import pooled_http

    def routable() -> bool:
        try:
            views = pooled_http.get(f"{url}/admin/instances", timeout=2).json()["instances"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return sum(1 for v in views if v.get("routable")) >= num

    wait_until(routable, timeout_s, f"{num} routable instances")


__all__ = ["MODEL", "PROFILE", "FaultReport", "LoadSize", "Place", "Timing", "command_line", "pids",
           "report", "resumed_since", "run_with_load", "start_cluster", "stop_cluster",
           "up_args", "wait_for_instances"]
