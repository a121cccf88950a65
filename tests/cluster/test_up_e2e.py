"""`strata up --replicas 3` end to end: real processes, the real gateway, the openai client.

Simulated instances (a fast synthetic latency profile) make failover stories quick and exact; the
last test serves the default model for real.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cluster_process import Cluster, start_cluster, wait_until
from harness import pooled_http
from harness.procs import Proc, spawn
from openai import OpenAI
from serve_process import shared_model_cache

from strata.registry.models import create_model_registry
from strata.sim.profile import LatencyProfile

MODEL = "sim-model"
# 20 ms per decode step: a 50-token stream lasts about a second
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.05, decode_ms_base=20.0, decode_ms_per_seq=0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("up")
    PROFILE.save(root / "profile.json")
    started = start_cluster(["--simulate", str(root / "profile.json"),
                             "--served-model-name", MODEL], root)
    yield started
    assert started.stop() == 0
    assert not (started.run_dir / "pids").exists()


@dataclass
class StreamResult:
    instance: str = ""
    first_event_at: float | None = None
    events: list[dict] = field(default_factory=list)
    error_at: float | None = None
    done: bool = False
    flowing: asyncio.Event = field(default_factory=asyncio.Event)  # its first event arrived

    @property
    def finish_reason(self) -> str | None:
        reasons = [e["choices"][0]["finish_reason"] for e in self.events if e.get("choices")]
        return next((r for r in reasons if r), None)


async def stream_one(client: httpx.AsyncClient, max_tokens: int,
                     result: StreamResult | None = None) -> StreamResult:
    body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    result = result or StreamResult()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        result.instance = resp.headers["x-strata-instance"]
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                result.error_at = time.monotonic()
            else:
                result.first_event_at = result.first_event_at or time.monotonic()
                result.events.append(event)
                result.flowing.set()
    return result


async def all_flowing(streams: list[StreamResult], timeout_s: float = 30) -> None:
    """Until every stream has received its first event (bounded)."""
    await asyncio.wait_for(asyncio.gather(*(s.flowing.wait() for s in streams)), timeout_s)


def gateway_counter(cluster: Cluster | Proc, name: str, instance: str | None = None) -> float:
    """A counter of the gateway's /metrics, summed over its labels or of one instance's
    (0 if never incremented)."""
    text = pooled_http.get(f"{cluster.url}/metrics", timeout=5).text
    prefix = f"strata:{name}_total" + (f'{{instance="{instance}"}}' if instance else "")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def resumed(cluster: Cluster) -> float:
    """Streams the gateway resumed on another instance after theirs failed."""
    text = pooled_http.get(f"{cluster.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('strata:gateway_stream_resumes_total{outcome="resumed"}'))


def instances_at(url: str) -> dict[str, dict]:
    """A gateway's instances by id, as it lists them."""
    body = pooled_http.get(f"{url}/admin/instances", timeout=5).json()
    return {i["instance_id"]: i for i in body["instances"]}


def test_openai_client_through_the_gateway_spreads_over_instances(cluster: Cluster) -> None:
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, max_tokens=6,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1
    served_by = {pooled_http.post(f"{cluster.url}/v1/completions", timeout=30,
                            json={"model": MODEL, "prompt": "x", "max_tokens": 2}
                            ).headers["x-strata-instance"] for _ in range(12)}
    assert len(served_by) >= 2
    states = pooled_http.get(f"{cluster.url}/v1/models").json()["data"]
    assert [m["id"] for m in states] == [MODEL]


def test_sigkill_under_load_fails_over_and_the_instance_rejoins(cluster: Cluster) -> None:
    victim = "sim-model-default-1"

    killed_pid = cluster.pids()[victim]
    broken_before = gateway_counter(cluster, "gateway_broken_streams")
    resumed_before = resumed(cluster)

    async def story() -> tuple[list[StreamResult], float]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as client:
            flowing = [StreamResult() for _ in range(12)]
            tasks = [asyncio.create_task(stream_one(client, 50, s)) for s in flowing]
            await all_flowing(flowing)
            assert victim in {s.instance for s in flowing}
            killed_at = time.monotonic()
            os.kill(killed_pid, signal.SIGKILL)
            late = [asyncio.create_task(stream_one(client, 10)) for _ in range(9)]
            return list(await asyncio.gather(*tasks, *late)), killed_at

    results, killed_at = asyncio.run(story())
    for r in results:  # the victim's streams are resumed elsewhere (on by default): none breaks
        assert r.done, "every stream ends with [DONE]"
        assert r.error_at is None and r.finish_reason == "length", (r.instance, r.events[-1:])
    assert all(r.first_event_at is not None and r.first_event_at < killed_at
               for r in results[:12])
    on_victim = sum(1 for r in results[:12] if r.instance == victim)
    num_broken = gateway_counter(cluster, "gateway_broken_streams") - broken_before
    assert 1 <= num_broken <= on_victim, "the killed instance had streams in flight"
    assert resumed(cluster) - resumed_before == num_broken, "each broken stream was resumed"

    def ejected() -> bool:
        view = cluster.instances().get(victim)
        return view is None or not view["routable"]

    wait_until(ejected, 10, f"{victim} ejected")
    wait_until(lambda: cluster.instances().get(victim, {}).get("routable", False), 90,
               f"{victim} back after its restart")
    assert cluster.pids()[victim] != killed_pid, "the supervisor restarted it as a new process"


def test_a_request_sent_to_an_instance_that_just_died_is_retried_on_another(
        cluster: Cluster) -> None:
    """A gateway of its own on the cluster's registry, round robin over the three instances and
    no active health check in the story's time: of three requests after a SIGKILL, at least one
    is sent to the dead instance, fails to connect and is retried on another; all succeed, and
    every retry is a failed attempt on the dead one."""
    wait_until(lambda: sum(i["routable"] for i in cluster.instances().values()) == 3, 90,
               "3 routable instances")
    gateway = spawn("gateway-rr", [sys.executable, "-m", "strata.cli", "gateway", "--port", "0",
                                   "--registry", f"sqlite:///{cluster.run_dir / 'registry.db'}",
                                   "--policy", "round_robin", "--health-check-interval-s", "60",
                                   "--log-level", "warning"], cluster.run_dir / "logs")
    try:
        gateway.url = gateway.wait_for_output(r"Strata gateway on (http://\S+) ", 60).group(1)
        gateway.wait_until(lambda: len(instances_at(gateway.url)) == 3, 30,
                           "3 instances in the round-robin gateway")
        victim = "sim-model-default-0"
        victim_url = instances_at(gateway.url)[victim]["url"]
        retries_before = gateway_counter(gateway, "gateway_retries")
        killed = {victim: cluster.pids()[victim]}
        os.kill(killed[victim], signal.SIGKILL)
        wait_until(lambda: not pooled_http.ok(f"{victim_url}/health"), 10, f"{victim} to be dead")
        answers = [pooled_http.post(f"{gateway.url}/v1/completions", timeout=30,
                                 json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                   for _ in range(3)]  # round robin over three: one of them was the dead one
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert victim not in {a.headers["x-strata-instance"] for a in answers}
        num_retries = gateway_counter(gateway, "gateway_retries") - retries_before
        assert num_retries >= 1  # one or more (round robin may point at it again)
        assert gateway_counter(gateway, "gateway_upstream_failures", victim) == num_retries
    finally:
        gateway.stop(timeout_s=30)
    wait_until(lambda: _restarted(cluster, killed), 30, f"{victim} restarted")  # left whole


def whole(cluster: Cluster) -> bool:
    """Every instance process of the cluster alive, and routable at its gateway (3)."""
    pids = [pid for name, pid in cluster.pids().items() if name.startswith(MODEL)]
    return (len(pids) == 3 and all(_is_alive(pid) for pid in pids)
            and sum(i["routable"] for i in cluster.instances().values()) == 3)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_instance_killed_at_once_under_load_fails_no_request(cluster: Cluster) -> None:
    """An outage shorter than a start is invisible: every instance SIGKILLed at once while four
    clients send non-streaming requests; the supervisor restarts them, and every request that
    found the fleet down waits at the gateway for an instance to come back instead of a 502.
    (On the module's cluster, before the drain story, which leaves one instance drained.)"""
    wait_until(lambda: whole(cluster), 90, "every instance up and routable")
    pids = {name: pid for name, pid in cluster.pids().items() if name.startswith(MODEL)}
    assert len(pids) == 3
    waits_before = gateway_counter(cluster, "gateway_recovery_waits")
    timed_out_before = recovery_waits_timed_out(cluster)
    statuses: list[tuple[float, int]] = []
    stop_at = [time.monotonic() + 600.0]

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at[0]:
            answer = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
            statuses.append((time.monotonic(), answer.status_code))

    async def story() -> float:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            loops = [asyncio.create_task(client_loop(client)) for _ in range(4)]
            while len(statuses) < 20:  # the load is flowing
                await asyncio.sleep(0.05)
            killed_at = time.monotonic()
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)
            while not _restarted(cluster, pids) or len(
                    [t for t, _ in statuses if t > killed_at]) < 20:
                assert time.monotonic() < killed_at + 180, "the fleet did not come back"
                await asyncio.sleep(0.2)
            stop_at[0] = time.monotonic()
            await asyncio.gather(*loops)
            return killed_at

    killed_at = asyncio.run(story())
    assert [code for _, code in statuses if code != 200] == []
    assert len([t for t, _ in statuses if t > killed_at]) >= 20  # served after the kill
    # some found it down, and none waited in vain
    assert gateway_counter(cluster, "gateway_recovery_waits") - waits_before >= 1
    assert recovery_waits_timed_out(cluster) == timed_out_before == 0.0


def recovery_waits_timed_out(cluster: Cluster) -> float | None:
    """The gateway's count of requests that waited for a recovery in vain (None: no such line)."""
    text = pooled_http.get(f"{cluster.url}/metrics", timeout=5).text
    prefix = 'strata:gateway_recovery_waits_total{outcome="timed_out"} '
    return next((float(line[len(prefix):]) for line in text.splitlines()
                 if line.startswith(prefix)), None)


def test_drain_loses_no_request(cluster: Cluster) -> None:
    wait_until(lambda: sum(i["routable"] for i in cluster.instances().values()) == 3, 90,
               "3 routable instances")
    target = "sim-model-default-2"

    async def story() -> list[StreamResult]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as client:
            flowing = [StreamResult() for _ in range(9)]
            tasks = [asyncio.create_task(stream_one(client, 30, s)) for s in flowing]
            await all_flowing(flowing)  # in flight everywhere, the target included
            while target not in {s.instance for s in flowing} and len(flowing) < 24:
                # the gateway may not route there yet (CI once saw all 9 on the other two,
                # right after the test before restarted an instance): more until one does
                flowing.append(StreamResult())
                tasks.append(asyncio.create_task(stream_one(client, 30, flowing[-1])))
                await all_flowing(flowing[-1:])
            assert target in {s.instance for s in flowing}
            resp = await client.post(f"/admin/instances/{target}/drain")
            assert resp.status_code in (200, 202), resp.text
            later = [asyncio.create_task(stream_one(client, 5)) for _ in range(6)]
            return list(await asyncio.gather(*tasks, *later))

    results = asyncio.run(story())
    assert all(r.done and r.error_at is None and r.finish_reason == "length" for r in results)
    assert all(r.instance != target for r in results[-6:]), "a draining instance gets no new work"


def test_a_restarted_cluster_keeps_the_catalogue_and_serves_what_its_flags_say(
    tmp_path: Path,
) -> None:
    first = start_cluster(["--simulate", "smollm2-cpu", "--model-version", "v1",
                           "--replicas", "1"], tmp_path)
    try:
        cluster_file = first.run_dir / "cluster.json"
        assert json.loads(cluster_file.read_text()) == {
            "gateway_url": first.url, "pid": first.pid,
            "registry_url": f"sqlite:///{first.run_dir.resolve()}/registry.db"}
        again = subprocess.run(
            [sys.executable, "-m", "strata.cli", "up", "--simulate", "smollm2-cpu"],
            env={**os.environ, "STRATA_RUN_DIR": str(first.run_dir)}, capture_output=True,
            text=True, timeout=60)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        assert first.stop() == 0
    assert not cluster_file.exists()
    registry_url = f"sqlite:///{first.run_dir.resolve()}/registry.db"

    second = start_cluster(["--simulate", "smollm2-cpu", "--model-version", "v2",
                            "--replicas", "1"], tmp_path)
    try:
        assert list(second.instances()) == ["SmolLM2-135M-Instruct-v2-0"]
        catalogue, deployments, routing = asyncio.run(registry_state(registry_url))
        assert catalogue == ["SmolLM2-135M-Instruct@v1", "SmolLM2-135M-Instruct@v2"]
        assert deployments == ["SmolLM2-135M-Instruct@v2"]
        assert routing == ("v2", "v1")
    finally:
        assert second.stop() == 0

    PROFILE.save(tmp_path / "profile.json")
    moved = subprocess.run(  # same name@version, other weights: refused, nothing started
        [sys.executable, "-m", "strata.cli", "up", "--model-version", "v1", "--simulate",
         str(tmp_path / "profile.json"), "--served-model-name", "SmolLM2-135M-Instruct"],
        env={**os.environ, "STRATA_RUN_DIR": str(second.run_dir)}, capture_output=True,
        text=True, timeout=60)
    assert moved.returncode == 1 and "pick another --model-version" in moved.stderr


async def registry_state(url: str) -> tuple[list[str], list[str], tuple[str | None, ...]]:
    models = create_model_registry(url)
    try:
        routing = await models.get_routing("SmolLM2-135M-Instruct")
        return ([v.key for v in await models.list_versions()],
                [d.key for d in await models.list_deployments()],
                (routing.live, routing.previous) if routing else ())
    finally:
        await models.close()


@pytest.mark.network
def test_up_serves_the_default_model_through_the_gateway(tmp_path: Path) -> None:
    # one replica: the spread over replicas is the simulated fleet's story above
    started = start_cluster(["--kv-cache-gb", "0.1"], tmp_path,
                            {"STRATA_CACHE_DIR": str(shared_model_cache())}, timeout_s=600,
                            replicas=1)
    try:
        client = OpenAI(base_url=f"{started.url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (reply.choices[0].message.content or "")
    finally:
        assert started.stop() == 0


def _restarted(cluster: Cluster, killed: dict[str, int]) -> bool:
    now = cluster.pids()
    return all(now.get(name) not in (None, pid) for name, pid in killed.items())
