"""Failover numbers: SIGKILL one instance of `strata up --replicas 3 --simulate` under load.

    .venv/bin/python bench/failover.py [--quick]

Each run starts a fresh cluster (so the supervisor's restart backoff starts from its base each
time), keeps CONCURRENCY streams of STREAM_TOKENS tokens flowing (closed loop; a 20 ms/step
synthetic profile makes a stream last about a second), SIGKILLs its second instance and measures:
- the time from the kill to the error event of every broken stream (p50 / max);
- requests that failed among those that had not started streaming at the kill (target 0);
- the time until the gateway stops routing to the instance (GET /admin/instances, every 20 ms);
- the time until it is routable again after the supervisor restarted it.
Writes .bench/results/failover.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from gateway_overhead import BENCH, PY, RESULTS, ROOT, load_average
from harness.procs import Proc, start_up

from strata.sim.profile import LatencyProfile

MODEL = "sim-failover"
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.05, decode_ms_base=20.0, decode_ms_per_seq=0.2)
VICTIM = f"{MODEL}-default-1"  # `strata up` names instances {model}-{version}-{index}
CONCURRENCY = 12
STREAM_TOKENS = 50


@dataclass
class Stream:
    sent_at: float
    instance: str = ""
    status: int = 0
    first_event_at: float | None = None
    error_at: float | None = None
    done: bool = False
    exception: str = ""
    ended_at: float = 0.0

    @property
    def failed(self) -> bool:
        return (self.status != 200 or self.error_at is not None or not self.done
                or bool(self.exception))


def start_cluster(root: Path, args: list[str] | None = None, replicas: int = 3,
                  env_extra: dict[str, str] | None = None) -> tuple[Proc, str, Path]:
    """`strata up` in its own process group; (process, gateway URL, run dir). Without `args`,
    the synthetic failover profile."""
    run_dir = root / "run"
    if args is None:
        PROFILE.save(root / "profile.json")
        args = ["--simulate", str(root / "profile.json"), "--served-model-name", MODEL]
    env = {**os.environ, "STRATA_RUN_DIR": str(run_dir), **(env_extra or {})}
    up = start_up(["--replicas", str(replicas), "--log-level", "warning", *args], run_dir,
                  env=env, python=PY, cwd=ROOT)
    return up, up.url, run_dir


def stop_cluster(up: Proc) -> None:
    """SIGINT `strata up` (it stops its children), then SIGKILL whatever is left in its group."""
    up.stop(timeout_s=60, sig=signal.SIGINT)


def pid_of(run_dir: Path, name: str) -> int:
    for line in (run_dir / "pids").read_text().splitlines():
        if line.split()[0] == name:
            return int(line.split()[1])
    raise RuntimeError(f"{name} not in {run_dir / 'pids'}")


async def stream_once(client: httpx.AsyncClient, out: list[Stream]) -> None:
    s = Stream(time.monotonic())
    out.append(s)
    body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": STREAM_TOKENS,
            "stream": True, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            s.status, s.instance = resp.status_code, resp.headers.get("x-strata-instance", "")
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    s.done = True
                elif line.startswith("data: ") and '"error"' in line:
                    s.error_at = s.error_at or time.monotonic()
                elif line.startswith("data: "):
                    s.first_event_at = s.first_event_at or time.monotonic()
    except Exception as e:  # a failed request is data
        s.exception = f"{type(e).__name__}: {e}"
    s.ended_at = time.monotonic()


async def keep_loaded(client: httpx.AsyncClient, out: list[Stream], until: list[float]) -> None:
    while time.monotonic() < until[0]:
        await stream_once(client, out)


async def watch(client: httpx.AsyncClient, marks: dict[str, float], killed: asyncio.Event,
                timeout_s: float) -> None:
    """Record when the victim stops being routable after the kill, and when it is back."""
    await killed.wait()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and "rejoined_at" not in marks:
        try:
            views = (await client.get("/admin/instances")).json()["instances"]
            view = next((v for v in views if v["instance_id"] == VICTIM), None)
            routable = bool(view and view.get("routable"))
            now = time.monotonic()
            if not routable and "ejected_at" not in marks:
                marks["ejected_at"] = now
            elif routable and "ejected_at" in marks:
                marks["rejoined_at"] = now
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.02)


async def story(url: str, run_dir: Path, load_before_s: float, load_after_s: float
                ) -> tuple[list[Stream], dict[str, float]]:
    streams: list[Stream] = []
    marks: dict[str, float] = {}
    killed = asyncio.Event()
    until = [time.monotonic() + 3600]
    async with httpx.AsyncClient(base_url=url, timeout=30,
                                 limits=httpx.Limits(max_connections=None)) as client:
        loaders = [asyncio.create_task(keep_loaded(client, streams, until))
                   for _ in range(CONCURRENCY)]
        watcher = asyncio.create_task(watch(client, marks, killed, 90))
        await asyncio.sleep(load_before_s)
        marks["killed_at"] = time.monotonic()
        os.kill(pid_of(run_dir, VICTIM), signal.SIGKILL)
        killed.set()
        until[0] = marks["killed_at"] + load_after_s
        await asyncio.gather(*loaders)
        await watcher
    return streams, marks


def measure(streams: list[Stream], marks: dict[str, float]) -> dict[str, Any]:
    k = marks["killed_at"]
    live = [s for s in streams if s.ended_at > k]  # in flight at the kill or sent after it
    streaming = [s for s in live if s.first_event_at is not None and s.first_event_at < k]
    broken = [s for s in streaming if s.error_at is not None or not s.done]
    waits = [s.error_at - k for s in broken if s.error_at is not None]
    not_streaming = [s for s in live if s not in streaming]
    ms = (lambda x: None if x is None else round(1000 * x, 1))  # noqa: E731
    return {
        "requests": len(streams), "in_flight_or_later": len(live),
        "streaming_at_kill": len(streaming),
        "broken_streams": len(broken), "broken_without_error_event": len(broken) - len(waits),
        "broken_on_victim": sum(s.instance == VICTIM for s in broken),
        "error_event_p50_ms": ms(statistics.median(waits)) if waits else None,
        "error_event_max_ms": ms(max(waits)) if waits else None,
        "not_streaming_at_kill": len(not_streaming),
        "failed_not_streaming": sum(s.failed for s in not_streaming),
        "failed_examples": [asdict(s) for s in not_streaming if s.failed][:3],
        "ejected_after_ms": ms(marks["ejected_at"] - k) if "ejected_at" in marks else None,
        "rejoined_after_ms": ms(marks["rejoined_at"] - k) if "rejoined_at" in marks else None,
    }


def one_run(i: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"failover-{i}-", dir=BENCH / "tmp"))
    proc, url, run_dir = start_cluster(root)
    try:
        streams, marks = asyncio.run(story(url, run_dir, 1.5, 2.0))
        row = measure(streams, marks)
    finally:
        stop_cluster(proc)
    row["load_average_1m"] = load_average()[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 run instead of 3")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    (BENCH / "tmp").mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"load_average_start": load_average(), "runs": []}
    cols = ("requests", "streaming_at_kill", "broken_streams", "error_event_p50_ms",
            "error_event_max_ms", "not_streaming_at_kill", "failed_not_streaming",
            "ejected_after_ms", "rejoined_after_ms")
    print("run " + " ".join(f"{c:>14.14}" for c in cols))
    for i in range(1 if args.quick else args.runs):
        row = one_run(i)
        report["runs"].append(row)
        print(f"{i:>3} " + " ".join(f"{row[c]!s:>14.14}" for c in cols), flush=True)
    report["load_average_end"] = load_average()
    out = RESULTS / "failover.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
