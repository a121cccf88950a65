"""`strata up --prefill 1 --decode 1 --pool fast=1 --autoscale` end to end (simulated
instances): the three pools are seeded, started with their roles and pools, and the gateway's
autoscaler decides for each on its own, on /metrics."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest
from harness.procs import start_up


@pytest.mark.timeout(120)
def test_each_pool_starts_in_its_place_and_is_sized_on_its_own(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = start_up(["--simulate", "smollm2-cpu", "--served-model-name", "smol", "--prefill", "1",
                   "--decode", "1", "--pool", "fast=1", "--autoscale", "--max-replicas", "3",
                   "--pool-replicas", "fast=1:1", "--autoscale-window-s", "1",
                   "--log-level", "warning"], run_dir,
                  env={**os.environ, "STRATA_RUN_DIR": str(run_dir)})
    try:
        views = httpx.get(f"{up.url}/admin/instances", timeout=5).json()["instances"]
        assert sorted((v["instance_id"], v["role"], v["pool"]) for v in views) == [
            ("smol-default-0", "prefill", "default"), ("smol-default-1", "decode", "default"),
            ("smol-default-2", "mixed", "fast")]

        def pools_decided() -> set[str]:
            text = httpx.get(f"{up.url}/metrics", timeout=5).text
            return set(re.findall(r'^strata:autoscaler_pool_decisions_total\{[^}]*pool="(\w+)"',
                                  text, re.M))

        up.wait_until(lambda: pools_decided() == {"prefill", "decode", "fast"}, 30,
                      "a decision for each pool")
        metrics = httpx.get(f"{up.url}/metrics", timeout=5).text
        assert 'strata:autoscaler_pool_replicas{kind="desired",pool="fast"} 1.0' in metrics
    finally:
        assert up.stop(timeout_s=60, sig=signal.SIGINT) == 0
