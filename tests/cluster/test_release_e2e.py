"""Releases end to end: `strata up`, two gateways, load, and the `strata` CLI as a user runs it.

Simulated instances (a fast synthetic latency profile) keep the stories short and exact:
- blue-green under load: zero failed requests (a failure is anything but a 200 whose body, JSON
  or SSE, has no error event and finishes with `length`); once a gateway has served v2 to a
  request without a session, every request it receives later is served by v2, at both
  gateways; sessions talking all along stay on v1 after their gateway switched, until v1
  retires, then move once, flagged, with their whole history; the response cache never answers
  for v2 with v1's answer;
- a canary whose TTFT is far worse than live is rolled back automatically;
- a canary that is slow only for the requests of a gateway that does not drive the release is
  rolled back (every gateway publishes its canary health to the registry);
- `strata rollback` while the release retires the old version (one of its instances still
  draining a long stream) brings the old version back and flips live back to it;
- the gateway driving a release is SIGKILLed while the release is not finished; restarted by the
  supervisor, it resumes the release from the registry to a consistent end.

The first four stories share one cluster: each releases versions of its own, from whichever
version is live, and starts once the previous story's release has settled. The rollback story has
a cluster of its own (its v1 decodes slowly).

How fast a release flips and how soon traffic moves are measured by bench/release_switch.py.
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
from harness import pooled_http
from harness.checks import completion_failure
from harness.procs import Proc, spawn

from strata.registry import create_model_registry
from strata.registry.models import Release
from strata.sim.profile import LatencyProfile

MODEL = "m"
FAST = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                      prefill_ms_per_token=0.05, decode_ms_base=5.0, decode_ms_per_seq=0.1)
# prefill 150x slower: a canary with this profile has a far worse TTFT p99 than live, even when
# other work on the machine makes live's p99 (the slowest of a few dozen requests) spike
SLOW = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=300.0,
                      prefill_ms_per_token=2.0, decode_ms_base=5.0, decode_ms_per_seq=0.1)

# decodes 16x slower than FAST: 500 tokens take about 40 s, longer than a release and its
# rollback (15 s on a busy 2-core machine), in a quarter of the events 2,000 tokens would cost
STREAMY = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.05, decode_ms_base=80.0, decode_ms_per_seq=0.1)


@dataclass
class Sample:
    started_at: float
    finished_at: float
    failure: str | None  # None: a whole success
    version: str = ""
    gateway: str = ""


@dataclass
class Load:
    """Requests from a few threads through the given gateways until stopped (bounded)."""

    gateways: list[str]
    num_threads: int = 3
    max_s: float = 90.0
    # between two requests of a thread: a few dozen requests a second are as many as the stories
    # need (a canary's min requests within its window, every gateway's switch seen), at a
    # fraction of the CPU of requests back to back
    pause_s: float = 0.1
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
                    failure = completion_failure(r.status_code, r.content,
                                                 is_stream=bool(body["stream"]),
                                                 finish_reasons={"length"})
                    version = r.headers.get("x-model-version", "")
                except httpx.HTTPError as exc:
                    failure, version = repr(exc), ""
                self.samples.append(Sample(started, time.time(), failure, version, gateway))
                n += 1
                self.stop.wait(self.pause_s)

    def num_from(self, gateway: str) -> int:
        return sum(s.gateway == gateway for s in list(self.samples))

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


def start_release_cluster(root: Path, v1_profile: LatencyProfile) -> Cluster:
    """`strata up`, 2 replicas of v1 (`v1_profile`); the profiles' files beside its run dir."""
    FAST.save(root / "fast.json")
    v1_profile.save(root / "v1.json")
    SLOW.save(root / "slow.json")
    # 3 s from a flip to the retirement of the old version: sessions pinned to it are seen
    # staying on it after the flip even when the machine is busy and a turn takes a second
    gateway_flags = ["--canary-window-s=5", "--canary-min-requests=8", "--release-lease-s=2",
                     "--release-propagation-s=3",
                     f"--response-cache=sqlite:///{root / 'cache.db'}"]
    return start_cluster(
        ["--simulate", str(root / "v1.json"), "--served-model-name", MODEL,
         "--model-version", "v1", "--session-store", f"sqlite:///{root / 'sessions.db'}",
         # room for a session's whole history: converse's 200 turns at most, ~31 tokens each
         "--max-model-len", "8192",
         *(f"--gateway-arg={flag}" for flag in gateway_flags)], root, replicas=2)


def profiles(cluster: Cluster) -> Path:
    """The folder of the cluster's profiles (fast.json, slow.json)."""
    return cluster.run_dir.parent


def routing(cluster: Cluster) -> dict:
    return pooled_http.get(f"{cluster.url}/admin/models", timeout=5).json()["models"][0]["routing"]


def versions(cluster: Cluster) -> list[str]:
    """The version of each of the cluster's instances."""
    return [i["version"] for i in cluster.instances().values()]


def live_version(cluster: Cluster) -> str:
    return str(routing(cluster)["live"])


def settled(cluster: Cluster) -> bool:
    """No release under way: 2 routable instances, all of the live version, no canary."""
    live, instances = routing(cluster), list(cluster.instances().values())
    return (live["canary"] is None and len(instances) == 2
            and all(i["version"] == live["live"] and i["routable"] for i in instances))


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster (v1: FAST) for the stories that start from any settled live version: each
    releases versions of its own, and ends settled (or waits for it, below)."""
    started = start_release_cluster(tmp_path_factory.mktemp("release"), FAST)
    yield started
    assert started.stop() == 0


@pytest.fixture
def cluster(shared_cluster: Cluster) -> Cluster:
    """The module's cluster once the previous story's release has settled."""
    wait_until(lambda: settled(shared_cluster), 60, "no release under way, 2 live instances")
    return shared_cluster


def second_gateway(cluster: Cluster) -> Proc:
    """Another gateway on the cluster's registry, on a port it binds itself."""
    proc = spawn("gateway2", [sys.executable, "-m", "strata.cli", "gateway", "--port", "0",
                              "--registry", f"sqlite:///{cluster.run_dir / 'registry.db'}",
                              "--log-level", "warning"], cluster.run_dir / "logs")
    proc.url = proc.wait_for_output(r"Strata gateway on (http://\S+) ", 60).group(1)
    proc.wait_until(lambda: pooled_http.ok(f"{proc.url}/ready"), 30,
                    "the second gateway's /ready")
    return proc


def chat_turn(url: str, session: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return pooled_http.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Session-Id": session})


def cached_call(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "the same question", "max_tokens": 6, "temperature": 0}
    return pooled_http.post(f"{url}/v1/completions", json=body, timeout=30)


@dataclass
class Turn:
    started_at: float
    failure: str | None  # None: a whole success
    version: str
    moved: str | None
    prompt_tokens: int
    gateway: str


def converse(gateways: list[str], session: str, stop: threading.Event, out: list[Turn],
             max_turns: int = 200) -> None:
    """One session's turns, one after the other, alternating gateways, until stopped."""
    for n in range(max_turns):
        if stop.is_set():
            return
        started, gateway = time.time(), gateways[n % len(gateways)]
        r = chat_turn(gateway, session, f"turn {n}")
        failure = completion_failure(r.status_code, r.content, is_stream=False)
        usage = r.json().get("usage", {}) if failure is None else {}
        out.append(Turn(started, failure, r.headers.get("x-model-version", ""),
                        r.headers.get("x-strata-version-moved"),
                        int(usage.get("prompt_tokens", 0)), gateway))
        time.sleep(0.2)  # a few turns a second each: dozens in the 3 s a flip leaves them


def switched_at(samples: list[Sample], gateway: str) -> float:
    """When `gateway` first answered a request without a session with v2 (inf: never)."""
    return min((s.finished_at for s in samples if s.gateway == gateway
                and s.version == f"{MODEL}@v2"), default=float("inf"))


def test_blue_green_release_under_load(cluster: Cluster) -> None:
    old = live_version(cluster)  # v1, unless another story released before
    gateway2 = second_gateway(cluster)
    gateways = [cluster.url, gateway2.url]
    try:
        first = cached_call(cluster.url)
        hit = cached_call(cluster.url)
        assert (first.headers["x-strata-cache"], hit.headers["x-strata-cache"]) == ("miss", "hit")
        assert hit.headers["x-model-version"] == f"{MODEL}@{old}"
        add = strata(cluster, "models", "add", f"{MODEL}@v2",
                     f"sim:{profiles(cluster) / 'fast.json'}")
        assert add.returncode == 0, add.stderr
        load = Load(gateways, pause_s=0.25).start()  # hundreds of requests in a release
        turns: dict[str, list[Turn]] = {f"s{i}": [] for i in range(4)}
        talkers = [threading.Thread(target=converse, args=(gateways, s, load.stop, out),
                                    daemon=True) for s, out in turns.items()]
        for talker in talkers:
            talker.start()
        wait_until(lambda: all(load.num_from(g) >= 10 for g in gateways)
                   and all(len(t) >= 2 for t in turns.values()), 60, "traffic on the live version")
        release = strata(cluster, "release", f"{MODEL}@v2")

        def switched_and_moved() -> bool:
            samples = list(load.samples)
            last_switch = max(switched_at(samples, g) for g in gateways)
            return (all(any(s.gateway == g and s.started_at > last_switch for s in samples)
                        for g in gateways)
                    and all(any(t.version.endswith("@v2") for t in list(history))
                            for history in turns.values()))

        wait_until(switched_and_moved, 60, "both gateways on v2 and every session moved")
        samples = load.finish()
        for talker in talkers:
            talker.join(timeout=60)
    finally:
        gateway2.stop(timeout_s=30)
    assert release.returncode == 0, release.stdout + release.stderr
    assert "is live" in release.stdout
    done = releases(cluster)[-1]
    assert [s for s, _ in done.history] == ["pending", "starting", "warming", "flipping",
                                            "retiring", "done"]
    assert done.stats["ready_to_flip_s"] >= 0.0  # how small it is: bench/release_switch.py
    assert len(samples) > 50 and [s for s in samples if s.failure is not None] == []
    for gateway in gateways:  # once a gateway served v2, it never served v1 again
        later = [s for s in samples if s.gateway == gateway
                 and s.started_at > switched_at(samples, gateway)]
        assert later and {s.version for s in later} == {f"{MODEL}@v2"}, gateway
    # answered before the release entered flipping: the old version's. (Not every request
    # *sent* before then: on a busy machine one sent a moment before reached its gateway after
    # the flip, and v2 answered it, rightly: seen once on a 2-core machine at load 8.)
    before = [s for s in samples if s.finished_at < entered(done, "flipping")]
    assert before and {s.version for s in before} == {f"{MODEL}@{old}"}
    for session, history in turns.items():
        assert history and all(t.failure is None for t in history), (session, history)
        versions = [t.version.partition("@")[2] for t in history]
        num_old = versions.count(old)
        assert versions == [old] * num_old + ["v2"] * (len(versions) - num_old), session
        assert 0 < num_old < len(versions), session  # started on the old one, ended on v2
        moved = [t.moved for t in history]
        assert moved == [None] * num_old + [f"{old}->v2"] + [None] * (len(history) - num_old - 1)
        tokens = [t.prompt_tokens for t in history]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # whole history
    # the flip did not move sessions: a gateway that already sent new requests to v2 still
    # sent a session's turn to v1 (until v1 retired)
    assert any(t.version.endswith(f"@{old}") and t.started_at > switched_at(samples, t.gateway)
               for history in turns.values() for t in history)
    after = cached_call(cluster.url)
    assert after.headers["x-strata-cache"] == "miss"  # the old answer is never served for v2
    assert after.headers["x-model-version"] == f"{MODEL}@v2"
    assert after.json()["system_fingerprint"].endswith(f"{MODEL}@v2")
    assert cached_call(cluster.url).headers["x-strata-cache"] == "hit"
    listing = strata(cluster, "models", "list")
    assert listing.returncode == 0
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [row[:3] for row in rows if row[1] in (old, "v2")] == [
        [MODEL, old, "previous"], [MODEL, "v2", "live"]]
    # any other version (another story's, on this cluster) has no role: its column is the count
    assert all(row[2].isdigit() for row in rows if row[1] not in (old, "v2")), rows


def test_a_slow_canary_is_rolled_back_automatically(cluster: Cluster) -> None:
    live = live_version(cluster)
    add = strata(cluster, "models", "add", f"{MODEL}@v3", f"sim:{profiles(cluster) / 'slow.json'}")
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
    assert [s for s in samples if s.failure is not None] == []
    assert f"{MODEL}@v3" in {s.version for s in samples}  # the canary did take traffic
    models = pooled_http.get(f"{cluster.url}/admin/models", timeout=5).json()["models"][0]
    assert (models["routing"]["live"], models["routing"]["canary"]) == (live, None)
    wait_until(lambda: set(versions(cluster)) == {live}, 30,
               "the canary's instances to retire")


def test_a_gateway_killed_mid_release_is_resumed_to_a_consistent_end(
        cluster: Cluster) -> None:
    add = strata(cluster, "models", "add", f"{MODEL}@v4", f"sim:{profiles(cluster) / 'fast.json'}")
    assert add.returncode == 0, add.stderr
    start = strata(cluster, "release", f"{MODEL}@v4", "--no-wait")
    assert start.returncode == 0, start.stderr
    os.kill(cluster.pids()["gateway"], signal.SIGKILL)  # the controller dies with it
    killed_in = releases(cluster)[-1]  # nothing drives it until the gateway is back
    assert not killed_in.is_terminal, f"the release had ended before the kill: {killed_in}"
    wait_until(lambda: releases(cluster)[-1].is_terminal, 60, "the release to be resumed",
               interval_s=0.2)
    final = releases(cluster)[-1]
    assert final.state == "done", (killed_in.state, final)
    states = [s for s, _ in final.history]
    assert states[-3:] == ["flipping", "retiring", "done"]
    assert len(states) == len(set(states))  # every step entered once, resumed where it stood
    follow = strata(cluster, "release", "--status", final.release_id)
    assert follow.returncode == 0 and "is live" in follow.stdout
    wait_until(lambda: set(versions(cluster)) == {"v4"}, 30,
               "only v4 instances")
    answer = pooled_http.post(f"{cluster.url}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert answer.headers["x-model-version"] == f"{MODEL}@v4"


def test_a_canary_slow_only_at_another_gateway_is_rolled_back(cluster: Cluster) -> None:
    live = live_version(cluster)
    gateway2 = second_gateway(cluster)
    try:
        add = strata(cluster, "models", "add", f"{MODEL}@v5",
                     f"sim:{profiles(cluster) / 'slow.json'}")
        assert add.returncode == 0, add.stderr
        # every request goes through gateway2; the release is driven by the cluster's gateway,
        # which sees none of them: it judges the canary (and live) on gateway2's windows alone
        load = Load([gateway2.url], pause_s=0.0).start()  # one gateway judges: every sample counts
        release = strata(cluster, "release", f"{MODEL}@v5", "--strategy", "canary", "--weight",
                         "0.5")
        samples = load.finish()
    finally:
        gateway2.stop(timeout_s=30)
    assert release.returncode == 1, release.stdout + release.stderr
    final = releases(cluster)[-1]
    assert [s for s, _ in final.history] == ["pending", "starting", "warming", "canary",
                                             "rolling_back", "rolled_back"]
    assert final.reason.startswith(f"canary {MODEL}@v5: TTFT p99"), final.reason
    driver_port = cluster.url.rpartition(":")[2]
    assert f"-{driver_port}-" in final.owner  # judged by the gateway that saw none of it
    assert [s for s in samples if s.failure is not None] == []
    assert {s.version for s in samples} == {f"{MODEL}@{live}", f"{MODEL}@v5"}
    print(f"pooled canary: {len(samples)} requests through the second gateway, "
          f"{sum(s.version.endswith('@v5') for s in samples)} on the canary, 0 failed")
    models = pooled_http.get(f"{cluster.url}/admin/models", timeout=5).json()["models"][0]
    assert (models["routing"]["live"], models["routing"]["canary"]) == (live, None)


@pytest.fixture
def streamy_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of its own: its v1 decodes slowly (STREAMY)."""
    started = start_release_cluster(tmp_path, STREAMY)
    yield started
    assert started.stop() == 0


def test_rollback_while_the_old_version_retires_brings_it_back(streamy_cluster: Cluster,
                                                               tmp_path: Path) -> None:
    cluster = streamy_cluster
    add = strata(cluster, "models", "add", f"{MODEL}@v2", f"sim:{tmp_path / 'fast.json'}")
    assert add.returncode == 0, add.stderr
    started, outcome = threading.Event(), {}

    def long_stream() -> None:
        """About 40 s of tokens from v1: one v1 instance drains it after the flip."""
        body = {"model": f"{MODEL}@v1", "prompt": "long", "max_tokens": 500,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body,
                          timeout=120) as r:
            chunks = []
            for chunk in r.iter_bytes():
                started.set()
                chunks.append(chunk)
            outcome["failure"] = completion_failure(r.status_code, b"".join(chunks),
                                                    is_stream=True, finish_reasons={"length"})

    streamer = threading.Thread(target=long_stream, daemon=True)
    streamer.start()
    assert started.wait(30), "the long stream never started"
    load = Load([cluster.url], num_threads=2).start()
    start = strata(cluster, "release", f"{MODEL}@v2", "--no-wait")
    assert start.returncode == 0, start.stderr
    # retiring: the v1 instance without the stream drained and left; the other one drains it
    wait_until(lambda: releases(cluster)[-1].state == "retiring"
               and versions(cluster).count("v1") == 1, 90,
               "one v1 instance left, draining the long stream")
    back = strata(cluster, "rollback", MODEL)
    assert back.returncode == 0, back.stdout + back.stderr
    assert "rolled back; v1 is live" in back.stdout
    final = releases(cluster)[-1]
    assert [s for s, _ in final.history] == ["pending", "starting", "warming", "flipping",
                                             "retiring", "rolling_back", "rolled_back"]
    models = pooled_http.get(f"{cluster.url}/admin/models", timeout=5).json()["models"][0]
    assert (models["routing"]["live"], models["routing"]["previous"]) == ("v1", "v2")
    wait_until(lambda: set(versions(cluster)) == {"v1"}, 30,
               "only v1 instances")
    samples = load.finish()
    assert [s for s in samples if s.failure is not None] == []
    assert {s.version for s in samples} == {f"{MODEL}@v1", f"{MODEL}@v2"}  # flipped, then back
    assert samples[-1].version == f"{MODEL}@v1"
    print(f"rollback while retiring: {len(samples)} requests during the release and its "
          "rollback, 0 failed")
    # the load stopped above: what is left of the stream flows alone
    streamer.join(timeout=120)
    assert outcome == {"failure": None}  # the draining instance finished its stream
    answer = pooled_http.post(f"{cluster.url}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert answer.headers["x-model-version"] == f"{MODEL}@v1"
