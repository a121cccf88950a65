"""A blue-green release end to end on `strata up --ray`: a real local Ray, the instances actors
that the driver reconciles toward the deployments the release writes (simulated instances on a
fast synthetic profile, one replica: CI-sized).

Story: v1 serves under load; `strata release m@v2` starts v2's instance as a new actor, warms
it, flips live and retires v1's actor; no request fails, v1 answers everything sent before the
flip and v2 everything sent after the gateway switched; only v2's actor is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster.test_release_e2e import FAST, MODEL, Load, entered, releases, strata, switched_at
from cluster_process import Cluster, start_cluster, wait_until

pytestmark = pytest.mark.needs("ray")
BLUE_GREEN_PATH = ["pending", "starting", "warming", "flipping", "retiring", "done"]


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[Cluster]:
    FAST.save(tmp_path / "fast.json")
    started = start_cluster(
        ["--ray", "--num-cpus-per-instance", "0.25", "--simulate", str(tmp_path / "fast.json"),
         "--served-model-name", MODEL, "--model-version", "v1"], tmp_path, replicas=1)
    yield started
    assert started.stop() == 0


def actor_of(cluster: Cluster, instance_id: str) -> str:
    """The command line of the parent of the process serving `instance_id` in `cluster` ("" if
    there is none)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if (b"--instance-id" not in argv
                    or argv[argv.index(b"--instance-id") + 1] != instance_id.encode()
                    or str(cluster.run_dir).encode() not in b" ".join(argv)):
                continue
            status = (proc / "status").read_text()
            ppid = next(line.split()[1] for line in status.splitlines()
                        if line.startswith("PPid:"))
            return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, StopIteration):
            continue
    return ""


def test_blue_green_release_on_ray(ray_cluster: Cluster, tmp_path: Path) -> None:
    assert "ray::InstanceActor" in actor_of(ray_cluster, "m-v1-0")  # v1 runs in a Ray actor
    add = strata(ray_cluster, "models", "add", f"{MODEL}@v2", f"sim:{tmp_path / 'fast.json'}")
    assert add.returncode == 0, add.stderr
    load = Load([ray_cluster.url], num_threads=2).start()
    wait_until(lambda: load.num_from(ray_cluster.url) >= 10, 60, "traffic on v1")
    release = strata(ray_cluster, "release", f"{MODEL}@v2", timeout_s=240)
    wait_until(lambda: any(s.started_at > switched_at(list(load.samples), ray_cluster.url)
                           for s in list(load.samples)), 60, "requests after the switch")
    samples = load.finish()
    assert release.returncode == 0, release.stdout + release.stderr
    final = releases(ray_cluster)[-1]
    assert [s for s, _ in final.history] == BLUE_GREEN_PATH
    assert len(samples) > 20 and [s for s in samples if s.failure is not None] == []
    before = [s for s in samples if s.started_at < entered(final, "flipping")]
    after = [s for s in samples if s.started_at > switched_at(samples, ray_cluster.url)]
    assert before and {s.version for s in before} == {f"{MODEL}@v1"}
    assert after and {s.version for s in after} == {f"{MODEL}@v2"}
    print(f"blue-green on Ray: {len(samples)} requests during the release ({len(before)} to v1 "
          f"before the flip, {len(after)} to v2 after), 0 failed; ready -> live flip in "
          f"{final.stats['ready_to_flip_s'] * 1000:.0f} ms")
    wait_until(lambda: set(ray_cluster.instances()) == {"m-v2-0"}, 60, "v1's actor retired")
    assert "ray::InstanceActor" in actor_of(ray_cluster, "m-v2-0")
    wait_until(lambda: actor_of(ray_cluster, "m-v1-0") == "", 60, "v1's process to exit")
    answer = httpx.post(f"{ray_cluster.url}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["x-model-version"] == f"{MODEL}@v2"
