"""Releases end to end: `strata up`, two gateways, load, and the `strata` CLI as a user runs it.

Simulated instances (a fast synthetic latency profile) keep the stories short and exact:
- blue-green under load: zero failed requests; once the flip is 1 s old, every new request is
  served by the new version at both gateways; sessions talking all along stay on v1 after the
  flip until v1 retires, then move once, flagged, with their whole history; the response cache
  never answers for v2 with v1's answer;
- a canary whose TTFT is far worse than live is rolled back automatically;
- the gateway driving a release is SIGKILLed mid-release; restarted by the supervisor, it
  resumes the release from the registry to a consistent end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cluster_process import Cluster, start_cluster, wait_until

from strata.cluster.local import free_port
from strata.registry import create_model_registry
from strata.registry.models import Release
from strata.sim.profile import LatencyProfile

MODEL = "m"
FAST = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                      prefill_ms_per_token=0.05, decode_ms_base=5.0, decode_ms_per_seq=0.1)
# prefill 40x slower: a canary with this profile has a far worse TTFT p99 than live
SLOW = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=80.0,
                      prefill_ms_per_token=2.0, decode_ms_base=5.0, decode_ms_per_seq=0.1)


@dataclass
class Sample:
    started_at: float
    status: int
    version: str = ""
    gateway: str = ""
    detail: str = ""


@dataclass
class Load:
    """Requests from a few threads through the given gateways until stopped (bounded)."""

    gateways: list[str]
    num_threads: int = 3
    max_s: float = 90.0
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(self.num_threads):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _run(self, index: int) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(timeout=30) as client:
            n = 0
            while not self.stop.is_set() and time.monotonic() < deadline:
                gateway = self.gateways[(index + n) % len(self.gateways)]
                body = {"model": MODEL, "prompt": f"load {index} {n}", "max_tokens": 8,
                        "ignore_eos": True, "stream": n % 2 == 1}
                started = time.time()
                try:
                    r = client.post(f"{gateway}/v1/completions", json=body)
                    ok = r.status_code == 200 and (not body["stream"] or "[DONE]" in r.text)
                    status = r.status_code if ok else 599
                    version = r.headers.get("x-model-version", "")
                    detail = "" if ok else f"{r.status_code} {r.headers} {r.text[-300:]}"
                except httpx.HTTPError as exc:
                    status, version, detail = 598, "", repr(exc)
                self.samples.append(Sample(started, status, version, gateway, detail))
                n += 1

    def finish(self) -> list[Sample]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        return list(self.samples)


def strata(cluster: Cluster, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """The CLI as a user runs it on the cluster's machine: no --gateway flag."""
    env = {**os.environ, "STRATA_RUN_DIR": str(cluster.run_dir)}
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout_s)


def releases(cluster: Cluster) -> list[Release]:
    async def read() -> list[Release]:
        models = create_model_registry(f"sqlite:///{cluster.run_dir / 'registry.db'}")
        try:
            return await models.list_releases(MODEL)
        finally:
            await models.close()

    return asyncio.run(read())


def entered(release: Release, state: str) -> float:
    return next(at for s, at in release.history if s == state)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    FAST.save(tmp_path / "fast.json")
    SLOW.save(tmp_path / "slow.json")
    gateway_flags = ["--canary-window-s=5", "--canary-min-requests=8", "--release-lease-s=2",
                     f"--response-cache=sqlite:///{tmp_path / 'cache.db'}"]
    started = start_cluster(
        ["--simulate", str(tmp_path / "fast.json"), "--served-model-name", MODEL,
         "--model-version", "v1", "--session-store", f"sqlite:///{tmp_path / 'sessions.db'}",
         *(f"--gateway-arg={flag}" for flag in gateway_flags)], tmp_path, replicas=2)
    yield started
    assert started.stop() == 0


def second_gateway(cluster: Cluster) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "gateway", "--port", str(port), "--registry",
         f"sqlite:///{cluster.run_dir / 'registry.db'}", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 30, "the second gateway")
    return proc, url


def chat_turn(url: str, session: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Session-Id": session})


def cached_call(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "the same question", "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


@dataclass
class Turn:
    started_at: float
    status: int
    version: str
    moved: str | None
    prompt_tokens: int


def converse(gateways: list[str], session: str, stop: threading.Event, out: list[Turn],
             max_turns: int = 200) -> None:
    """One session's turns, one after the other, alternating gateways, until stopped."""
    for n in range(max_turns):
        if stop.is_set():
            return
        started = time.time()
        r = chat_turn(gateways[n % len(gateways)], session, f"turn {n}")
        usage = r.json().get("usage", {}) if r.status_code == 200 else {}
        out.append(Turn(started, r.status_code, r.headers.get("x-model-version", ""),
                        r.headers.get("x-strata-version-moved"),
                        int(usage.get("prompt_tokens", 0))))
        time.sleep(0.05)


def test_blue_green_release_under_load(cluster: Cluster, tmp_path: Path) -> None:
    gateway2, url2 = second_gateway(cluster)
    gateways = [cluster.url, url2]
    try:
        first = cached_call(cluster.url)
        hit = cached_call(cluster.url)
        assert (first.headers["x-strata-cache"], hit.headers["x-strata-cache"]) == ("miss", "hit")
        assert hit.headers["x-model-version"] == f"{MODEL}@v1"
        add = strata(cluster, "models", "add", f"{MODEL}@v2", f"sim:{tmp_path / 'fast.json'}")
        assert add.returncode == 0, add.stderr
        load = Load(gateways).start()
        turns: dict[str, list[Turn]] = {f"s{i}": [] for i in range(4)}
        talkers = [threading.Thread(target=converse, args=(gateways, s, load.stop, out),
                                    daemon=True) for s, out in turns.items()]
        for talker in talkers:
            talker.start()
        time.sleep(1.0)
        release = strata(cluster, "release", f"{MODEL}@v2")
        time.sleep(1.5)
        samples = load.finish()
        for talker in talkers:
            talker.join(timeout=60)
    finally:
        gateway2.send_signal(signal.SIGTERM)
        gateway2.wait(timeout=30)
    assert release.returncode == 0, release.stdout + release.stderr
    assert "is live" in release.stdout
    done = releases(cluster)[-1]
    assert [s for s, _ in done.history] == ["pending", "starting", "warming", "flipping",
                                            "retiring", "done"]
    assert done.stats["ready_to_flip_s"] < 1.0
    flipped_at = entered(done, "retiring")
    assert len(samples) > 50 and [s for s in samples if s.status != 200] == []
    late = [s for s in samples if s.started_at > flipped_at + 1.0]
    assert late and {s.version for s in late} == {f"{MODEL}@v2"}
    assert {s.gateway for s in late} == set(gateways)
    before = [s for s in samples if s.started_at < entered(done, "flipping")]
    assert before and {s.version for s in before} == {f"{MODEL}@v1"}
    for session, history in turns.items():
        assert history and all(t.status == 200 for t in history), session
        versions = [t.version.partition("@")[2] for t in history]
        num_v1 = versions.count("v1")
        assert versions == ["v1"] * num_v1 + ["v2"] * (len(versions) - num_v1), session
        assert 0 < num_v1 < len(versions), session  # started on v1, ended on v2
        moved = [t.moved for t in history]
        assert moved == [None] * num_v1 + ["v1->v2"] + [None] * (len(history) - num_v1 - 1)
        tokens = [t.prompt_tokens for t in history]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # whole history
        # the flip did not move it: it stayed on v1 until v1 retired
        assert any(t.version.endswith("@v1") for t in history if t.started_at > flipped_at + 0.5)
    after = cached_call(cluster.url)
    assert after.headers["x-strata-cache"] == "miss"  # v1's answer is never served for v2
    assert after.headers["x-model-version"] == f"{MODEL}@v2"
    assert after.json()["system_fingerprint"].endswith(f"{MODEL}@v2")
    assert cached_call(cluster.url).headers["x-strata-cache"] == "hit"
    listing = strata(cluster, "models", "list")
    assert listing.returncode == 0
    assert [line.split()[:3] for line in listing.stdout.splitlines()[1:]] == [
        [MODEL, "v1", "previous"], [MODEL, "v2", "live"]]


def test_a_slow_canary_is_rolled_back_automatically(cluster: Cluster, tmp_path: Path) -> None:
    add = strata(cluster, "models", "add", f"{MODEL}@v3", f"sim:{tmp_path / 'slow.json'}")
    assert add.returncode == 0, add.stderr
    load = Load([cluster.url]).start()
    release = strata(cluster, "release", f"{MODEL}@v3", "--strategy", "canary", "--weight",
                     "0.5")
    samples = load.finish()
    assert release.returncode == 1, release.stdout + release.stderr
    assert "rolled_back" in release.stdout and "TTFT p99" in release.stdout
    final = releases(cluster)[-1]
    assert [s for s, _ in final.history] == ["pending", "starting", "warming", "canary",
                                             "rolling_back", "rolled_back"]
    assert [s for s in samples if s.status != 200] == []
    assert f"{MODEL}@v3" in {s.version for s in samples}  # the canary did take traffic
    models = httpx.get(f"{cluster.url}/admin/models", timeout=5).json()["models"][0]
    assert (models["routing"]["live"], models["routing"]["canary"]) == ("v1", None)
    wait_until(lambda: all(i["version"] == "v1" for i in cluster.instances().values()), 30,
               "the canary's instances to retire")


def test_a_gateway_killed_mid_release_is_resumed_to_a_consistent_end(
        cluster: Cluster, tmp_path: Path) -> None:
    add = strata(cluster, "models", "add", f"{MODEL}@v2", f"sim:{tmp_path / 'fast.json'}")
    assert add.returncode == 0, add.stderr
    start = strata(cluster, "release", f"{MODEL}@v2", "--no-wait")
    assert start.returncode == 0, start.stderr
    os.kill(cluster.pids()["gateway"], signal.SIGKILL)  # the controller dies with it
    killed_in = releases(cluster)[-1].state
    wait_until(lambda: releases(cluster)[-1].is_terminal, 60, "the release to be resumed")
    final = releases(cluster)[-1]
    assert final.state == "done", (killed_in, final)
    states = [s for s, _ in final.history]
    assert states[-3:] == ["flipping", "retiring", "done"]
    assert len(states) == len(set(states))  # every step entered once, resumed where it stood
    follow = strata(cluster, "release", "--status", final.release_id)
    assert follow.returncode == 0 and "is live" in follow.stdout
    wait_until(lambda: {i["version"] for i in cluster.instances().values()} == {"v2"}, 30,
               "only v2 instances")
    answer = httpx.post(f"{cluster.url}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert answer.headers["x-model-version"] == f"{MODEL}@v2"
