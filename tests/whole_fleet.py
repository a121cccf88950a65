"""The whole fleet of issue 24 (tests/cluster/test_whole_fleet.py, and bench/whole_fleet.py
at ten times its load): one `strata up` with every feature on, real processes, the tiny model in
float32 on the CPU.

The fleet: client keys of two tenants, an admin key and the fleet's internal key; `strata up`
starts 1 prefill and 1 decode instance (T=1) and one mixed instance in pool `fast`, where the
interactive class is routed; a second decode instance at tensor-parallel T=2 (two rank
processes) joins the same registry as `strata serve --role decode -tp 2` (strata up gives every
instance of a version one layout), its rank 0 unable to run any step of a prompt holding
`FAULT_RUN`. Chat sessions live in a real Redis (the instances' history)
with sticky routing pinned in the same Redis (the gateway's pins); `--policy cache_aware`; the
autoscaler on (each pool held at its size by its bounds: its decisions are visible and change
nothing), the interactive class with SLOs of its own; a KV cache of 49 blocks, so long streams
preempt.

Here: the fleet, its clients (`ask`, `Load`), the faults (a decode instance killed mid-stream,
the whole fleet killed at once), a canary release of v2 to the end, and the check of every
answer against one plain instance of its version.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from harness.checks import completion_failure
from harness.procs import Proc, http_ok, start_up, wait_until
from resume_streams import events_of, frames_of
from serve_process import start_serve
from tiny_models import make_tiny_model_dir

from strata.cluster.local import local_registry_url
from strata.protocol.keys import auth_header
from strata.registry import InstanceRecord, create_model_registry, create_registry
from strata.registry.models import Release

MODEL = "tiny"
KEY_A, KEY_B, ADMIN_KEY, INTERNAL_KEY = "k-tenant-a", "k-tenant-b", "k-admin", "k-internal"
CHAT = "/v1/chat/completions"
TP2 = "tiny-v1-decode-tp2"
# 49 blocks of 8 tokens (the tiny model holds 512 bytes a token): two 200-token streams on one
# instance do not fit, so one is preempted
KV_CACHE_GB = 0.00019
# the interactive class's own targets (TTFT p95, ITL p95 s), which its pool `fast` takes; loose
# enough that they never move the pool (its bounds hold it at one instance anyway)
FAST_SLO = (30.0, 5.0)
# every pool's rate measured within a few rounds: the default 30 s window outlasts the whole
# test on a quiet machine, so its pools would decide only in their first window
AUTOSCALE_WINDOW_S = 5
# rank 0 of the T=2 decode instance cannot run its share of a step of a request whose prompt
# holds this run of token ids, failing mid-step after its first collective (a test fault,
# strata/server/pd/faults.py): no other prompt holds it
FAULT_RUN = (7, 11, 7, 11, 7, 11, 7, 11)

@dataclass
class Fleet:
    up: Proc
    url: str
    run_dir: Path
    env: dict[str, str]
    v1_dir: Path
    v2_dir: Path
    redis_url: str
    tp2: Proc  # the decode instance at T=2, started beside `strata up`

    def pid_of(self, iid: str) -> int:
        return self.tp2.pid if iid == TP2 else self.pids()[iid]

    def pids(self) -> dict[str, int]:
        lines = (self.run_dir / "pids").read_text().split("\n")
        return {name: int(pid) for name, pid in (line.split() for line in lines if line)}

    def instances(self) -> dict[str, dict[str, Any]]:
        body = httpx.get(f"{self.url}/admin/instances", timeout=5,
                         headers=auth_header(ADMIN_KEY)).json()
        return {i["instance_id"]: i for i in body["instances"]}

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10, headers=auth_header(ADMIN_KEY)).text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the gateway's samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] == f"strata:{name}" and all(
                    f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total

    def strata(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """The CLI as an operator runs it on the fleet's machine."""
        return subprocess.run([sys.executable, "-m", "strata.cli", *args], env=self.env,
                              text=True, capture_output=True, timeout=timeout_s)

@contextlib.contextmanager
def start_fleet(root: Path, redis_url: str) -> Iterator[Fleet]:
    """The fleet (the module docstring) under `root`, its sessions and pins in `redis_url`;
    stopped on exit (`strata up` must exit 0)."""
    root.mkdir(parents=True, exist_ok=True)
    v1_dir = make_tiny_model_dir(root / "v1", seed=0, initializer_range=0.2)
    v2_dir = make_tiny_model_dir(root / "v2", seed=1, initializer_range=0.2)
    keys = {"client": f"{KEY_A}\n{KEY_B}\n", "admin": ADMIN_KEY, "internal": INTERNAL_KEY}
    for name, text in keys.items():
        (root / f"{name}.keys").write_text(text)
    (root / "faults.json").write_text(json.dumps(
        {"share_fault": {"rank": 0, "prompt_run": list(FAULT_RUN), "at_call": 1}}))
    run_dir = root / "run"
    instance_flags = ["--dtype", "float32", "--block-size", "8", "--max-model-len", "256",
                      "--kv-cache-gb", str(KV_CACHE_GB), "--max-num-seqs", "4",
                      "--session-store", redis_url]
    env = {**os.environ, "STRATA_RUN_DIR": str(run_dir), "STRATA_ADMIN_KEYS": ADMIN_KEY}
    gateway = ["--class-pool=interactive=fast", "--session-routing=sticky",
               f"--session-store={redis_url}", "--pd-min-uncached-tokens=8",
               "--canary-window-s=4", "--canary-min-requests=4", "--release-propagation-s=2",
               "--scale-interval-s=1", f"--model-root={root}", "--start-wait-s=150",
               f"--class-slo=interactive={FAST_SLO[0]}:{FAST_SLO[1]}"]
    up = start_up([str(v1_dir), "--served-model-name", MODEL, "--model-version", "v1",
                   "--prefill", "1", "--decode", "1", "--pool", "fast=1",
                   *instance_flags, "--threads-per-instance", "1",
                   "--policy", "cache_aware", "--log-level", "warning",
                   "--api-key-file", str(root / "client.keys"),
                   "--admin-key-file", str(root / "admin.keys"),
                   "--internal-key-file", str(root / "internal.keys"),
                   "--autoscale", "--min-replicas", "1", "--max-replicas", "1",
                   "--autoscale-window-s", str(AUTOSCALE_WINDOW_S),
                   "--pool-replicas", "prefill=1:1", "--pool-replicas", "decode=1:1",
                   "--pool-replicas", "fast=1:1",
                   *(f"--gateway-arg={flag}" for flag in gateway)],
                  run_dir, env=env, timeout_s=300)
    try:
        tp2 = start_serve([str(v1_dir), "--served-model-name", MODEL, "--model-version", "v1",
                           "--role", "decode", "--tensor-parallel-size", "2", "--threads", "1",
                           "--instance-id", TP2, "--registry", local_registry_url(run_dir),
                           *instance_flags, "--log-level", "warning",
                           "--api-key-file", str(root / "client.keys"),
                           "--admin-key-file", str(root / "admin.keys"),
                           "--internal-key-file", str(root / "internal.keys"),
                           "--fault-config", str(root / "faults.json")],
                          cache_dir=root / "cache", log_dir=run_dir / "logs", name=TP2,
                          timeout_s=180)
    except BaseException:
        up.stop(timeout_s=60, sig=signal.SIGINT)
        raise
    fleet = Fleet(up, up.url, run_dir, env, v1_dir, v2_dir, redis_url, tp2.process)
    try:
        wait_until(lambda: routable(fleet, TP2), 60, "the T=2 decode instance routable")
        yield fleet
    finally:
        tp2.process.stop()
        assert up.stop(timeout_s=60, sig=signal.SIGINT) == 0

@dataclass
class Answer:
    """One request through the fleet and what came back."""

    key: str
    body: dict[str, Any]  # the messages as the model saw them (a session's whole history)
    is_stream: bool
    status: int
    raw: bytes
    version: str
    instance: str
    failure: str | None
    started_at: float = 0.0  # time.monotonic() when sent
    elapsed_s: float = 0.0  # to the whole answer

    @property
    def tokens(self) -> list[list[int]]:
        return token_bytes(self.raw, self.is_stream)

    @property
    def usage(self) -> dict[str, Any]:
        return usage_of(self.raw, self.is_stream)

def token_bytes(raw: bytes, is_stream: bool) -> list[list[int]]:
    if is_stream:
        return [t["bytes"] for e in events_of(frames_of(raw)) for c in e["choices"]
                if c.get("logprobs") for t in c["logprobs"]["content"]]
    (choice,) = json.loads(raw)["choices"]
    return [t["bytes"] for t in choice["logprobs"]["content"]]

def usage_of(raw: bytes, is_stream: bool) -> dict[str, Any]:
    if is_stream:
        return next(e["usage"] for e in events_of(frames_of(raw)) if e.get("usage"))
    return dict(json.loads(raw)["usage"])

def ask(url: str, key: str, messages: list[dict[str, str]], *, stream: bool = False,
        max_tokens: int = 12, headers: dict[str, str] | None = None) -> Answer:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    sent = body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})
    started = time.monotonic()
    try:
        r = httpx.post(f"{url}{CHAT}", json=sent, headers=auth_header(key) | (headers or {}),
                       timeout=200)
    except httpx.HTTPError as exc:
        return Answer(key, body, stream, 0, b"", "", "", repr(exc), started,
                      time.monotonic() - started)
    failure = completion_failure(r.status_code, r.content, is_stream=stream,
                                 finish_reasons={"length"})
    return Answer(key, body, stream, r.status_code, r.content,
                  r.headers.get("x-model-version", ""), r.headers.get("x-strata-instance", ""),
                  failure, started, time.monotonic() - started)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]

@dataclass
class Load:
    """Both tenants' requests (plain and streamed, long prompts no one asked before) from
    `workers` threads each, one request at a time with `pause_s` between, until stopped or
    `max_s` has passed; every answer kept."""

    url: str
    workers: int = 1
    pause_s: float = 0.2
    max_s: float = 300.0
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for key, worker in [(k, w) for w in range(self.workers) for k in (KEY_A, KEY_B)]:
            thread = threading.Thread(target=self._run, args=(key, worker), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _run(self, key: str, worker: int) -> None:
        deadline = time.monotonic() + self.max_s
        n = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            text = f"load {key[-1]}.{worker} {n}: " + LONG
            self.answers.append(ask(self.url, key, user(text), stream=n % 2 == 1))
            n += 1
            time.sleep(self.pause_s)

    def num_on(self, version: str) -> int:
        return sum(a.version == version for a in list(self.answers))

    def finish(self) -> list[Answer]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=240)
        return list(self.answers)


LONG = ("the river ran high all spring and the mill turned day and night while the town slept, "
        "the miller counting sacks")


def role_of(fleet: Fleet, role: str) -> list[str]:
    return sorted(iid for iid, i in fleet.instances().items() if i["role"] == role)

def routable(fleet: Fleet, iid: str) -> bool:
    try:
        return bool(fleet.instances().get(iid, {}).get("routable"))
    except (httpx.HTTPError, ValueError):
        return False

def cached_tokens(answer: Answer) -> int:
    return int((answer.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

def instance_metric(url: str, name: str, **labels: str) -> float:
    """The sum of an instance's samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10, headers=auth_header(ADMIN_KEY)).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == f"strata:{name}"
               and all(f'{k}="{v}"' in line for k, v in labels.items()))

def decode_killed_mid_stream(fleet: Fleet) -> Answer:
    """A long stream's decode instance is SIGKILLed at its first frame: the stream goes on. A
    decode instance can send its last frame before the kill lands (the gateway then holds the
    whole stream and nothing resumes): such a try tests nothing and is made again once the
    victim is back, at most three times."""
    body = {"model": MODEL, "messages": user("a long tale"), "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "stream": True,
            "stream_options": {"include_usage": True}}
    for _ in range(3):
        before = {o: fleet.metric("gateway_stream_resumes_total", outcome=o)
                  for o in ("resumed", "failed", "impossible")}
        killed_pid, answer = stream_with_kill(fleet, body)
        outcomes = {o: fleet.metric("gateway_stream_resumes_total", outcome=o)
                    for o in ("resumed", "failed", "impossible")}
        if answer.instance == TP2:
            fleet.tp2.start()
        if outcomes != before or answer.failure is not None:
            break
        wait_until(functools.partial(victim_back, fleet, answer.instance, killed_pid), 120,
                   f"{answer.instance} back after its kill")
    assert outcomes["resumed"] == before["resumed"] + 1, (
        f"victim {answer.instance}, killed after {len(answer.raw)} bytes; resumes {outcomes} "
        f"(before {before}); {answer.failure}\n" + fleet.up.tail(60))
    assert len(answer.tokens) == 200
    return answer

def stream_with_kill(fleet: Fleet, body: dict[str, Any]) -> tuple[int | None, Answer]:
    """`body` streamed, its decode instance killed at the stream's first frame."""
    raw, victim, killed_pid = b"", "", None
    # read before the first frame: between it and the kill nothing waits on HTTP
    roles = {iid: instance["role"] for iid, instance in fleet.instances().items()}
    with httpx.stream("POST", f"{fleet.url}{CHAT}", json=body, headers=auth_header(KEY_A),
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        victim = response.headers["x-strata-instance"]
        victim_pid = fleet.pid_of(victim)
        for i, chunk in enumerate(response.iter_raw()):
            raw += chunk
            if i == 0:
                killed_pid = victim_pid
                kill(fleet, victim)
        assert roles[victim] == "decode"
        version = response.headers.get("x-model-version", "")
    failure = completion_failure(200, raw, is_stream=True, finish_reasons={"length"})
    request = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return killed_pid, Answer(KEY_A, request, True, 200, raw, version, victim, failure)

def victim_back(fleet: Fleet, iid: str, killed_pid: int | None) -> bool:
    """The killed instance answers again as a new process, and is routable."""
    try:
        if fleet.pid_of(iid) == killed_pid:
            return False
        url = fleet.instances().get(iid, {}).get("url")
    except (KeyError, httpx.HTTPError, ValueError):
        return False
    return url is not None and http_ok(f"{url}/health") and routable(fleet, iid)

def kill(fleet: Fleet, iid: str) -> None:
    """SIGKILL an instance (the T=2 one with its rank)."""
    if iid == TP2:
        fleet.tp2.kill()
    else:
        os.kill(fleet.pids()[iid], signal.SIGKILL)

def outage(fleet: Fleet, load: Load) -> float:
    """Under load, while the decode instance killed mid-stream restarts, the prefill instance
    and every other instance still up (the interactive pool's too) are SIGKILLed at once:
    requests wait for the restarts (nothing sent yet: they are not failed), and once the fleet
    is back it prefills remotely again. Returns the seconds from the first kill until every
    instance was routable again.""" 
    (prefill,) = role_of(fleet, "prefill")
    everyone = sorted(fleet.instances())
    num_before = len(load.answers)
    waits = fleet.metric("gateway_recovery_waits_total", outcome="recovered")
    killed_at = time.monotonic()
    for iid in [prefill, *(i for i in everyone if i != prefill and routable(fleet, i))]:
        kill(fleet, iid)
        if iid == TP2:  # no supervisor restarts it: the operator does
            fleet.tp2.start()
    for iid in everyone:
        wait_until(lambda iid=iid: routable(fleet, iid), 180, f"{iid} back")
    back_s = time.monotonic() - killed_at
    wait_until(lambda: len(load.answers) >= num_before + 4, 120, "load after the outage")
    assert fleet.metric("gateway_recovery_waits_total", outcome="recovered") > waits
    ok = fleet.metric("gateway_pd_prefills_total", outcome="ok")
    wait_until(lambda: fleet.metric("gateway_pd_prefills_total", outcome="ok") > ok, 60,
               "a remote prefill after the restart")
    prefill_url = fleet.instances()[prefill]["url"]
    assert instance_metric(prefill_url, "pd_handshake_refusals_total") == 0
    return back_s

def release_v2(fleet: Fleet, load: Load) -> None:
    """A canary of v2 (other weights, tensor-parallel T=2) under load, to the end."""
    add = fleet.strata("models", "add", f"{MODEL}@v2", str(fleet.v2_dir),
                       "--serve-arg=--tensor-parallel-size=2", "--serve-arg=--threads=1")
    assert add.returncode == 0, add.stdout + add.stderr
    start = fleet.strata("release", f"{MODEL}@v2", "--strategy", "canary", "--weight", "0.5",
                         "--replicas", "1", "--no-wait")
    assert start.returncode == 0, start.stdout + start.stderr
    # v1 retires: the launcher drains its instances, the operator the one it started itself
    wait_until(lambda: asyncio.run(registry_state(fleet))[0].state in ("retiring", "done"),
               240, "the release to retire v1")
    fleet.tp2.stop(timeout_s=60)
    wait_until(lambda: asyncio.run(registry_state(fleet))[0].is_terminal, 120,
               "the release to end")
    release_id = asyncio.run(registry_state(fleet))[0].release_id
    release = fleet.strata("release", "--status", release_id)
    assert release.returncode == 0, release.stdout + release.stderr
    assert "is live" in release.stdout
    assert load.num_on(f"{MODEL}@v2") >= 1
    wait_until(lambda: {i["version"] for i in fleet.instances().values()} == {"v2"}, 60,
               "only v2 instances")
    done, records = asyncio.run(registry_state(fleet))
    assert [s for s, _ in done.history] == ["pending", "starting", "warming", "canary",
                                            "flipping", "retiring", "done"]
    assert [(r.version, r.layout, len(r.ranks)) for r in records] == [("v2", "tp2", 2)]

async def registry_state(fleet: Fleet) -> tuple[Release, list[InstanceRecord]]:
    """The latest release and the registered instances."""
    url = local_registry_url(fleet.run_dir)
    models, instances = create_model_registry(url), create_registry(url)
    try:
        return (await models.list_releases(MODEL))[-1], list(await instances.list_instances())
    finally:
        await models.close()
        await instances.close()

def check_against_references(answers: list[Answer], fleet: Fleet, tmp_path: Path) -> None:
    """Every answer, token for token, one plain instance's of its version (given the same
    messages, without a stream)."""
    dirs = {f"{MODEL}@v1": fleet.v1_dir, f"{MODEL}@v2": fleet.v2_dir}
    assert {a.version for a in answers} <= set(dirs)
    for version, model_dir in dirs.items():
        mine = [a for a in answers if a.version == version]
        ref = start_serve([str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                           "--block-size", "8", "--max-model-len", "256", "--threads", "1",
                           "--log-level", "warning"], cache_dir=tmp_path / "cache",
                          log_dir=tmp_path, name=f"reference-{version}", timeout_s=120)
        try:
            for a in mine:
                expected = ask(ref.url, "", a.body["messages"], max_tokens=a.body["max_tokens"])
                assert expected.failure is None, expected.failure
                assert a.tokens == expected.tokens, (version, a.body)
                assert a.usage["prompt_tokens"] == expected.usage["prompt_tokens"]
        finally:
            ref.stop()
