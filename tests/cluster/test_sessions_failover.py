"""Sessions survive failures: real `strata serve` and `strata gateway` processes and a real Redis.

Story 1: two gateways (hybrid session routing, pins in Redis) and three tiny-model instances
(session store in Redis, one SQLite registry). A 10-turn greedy conversation sends only each new
user message with `X-Session-Id`, alternating gateways; the instance that answered each turn is
SIGKILLed right after it and restarted on the same port (two of three are always up). Every turn
must see the whole history (prompt_tokens of the full history) and answer exactly what one
instance answers, with no failure, when sent the full history explicitly.

Story 2: Redis (`appendfsync always`) is SIGKILLed and restarted while turns flow through a gateway:
every acknowledged turn is in the stored history afterwards, and no turn is half stored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_process import wait_until
from redis_server import RedisServer, free_port
from tiny_models import make_tiny_model_dir

MODEL = "tiny"
MAX_TOKENS = 8
NUM_TURNS = 10
START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
OUTAGE_S = 2.0
READY = re.compile(r"(Strata serving \S+|Strata gateway) on (http://127\.0\.0\.1:\d+)")

pytestmark = pytest.mark.timeout(240)


@dataclass
class Proc:
    """One CLI subprocess on a fixed port; `start` waits for its ready line (bounded)."""

    args: list[str]
    log: Path
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    _log_offset: int = 0

    def spawn(self) -> None:
        self._log_offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "strata.cli", *self.args],
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=os.environ.copy())

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not (m := READY.search(self.new_output())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.args[0]} did not start:\n{self.new_output()[-3000:]}")
            time.sleep(0.05)
        self.url = m.group(2)

    def new_output(self) -> str:
        return self.log.read_bytes()[self._log_offset:].decode(errors="replace")

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def kill(self) -> None:
        """SIGKILL by PID (a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)


def serve(root: Path, model_dir: Path, name: str, *, store: str, registry: str) -> Proc:
    port = free_port()
    return Proc(["serve", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                 "--device", "cpu", "--threads", "1", "--port", str(port), "--instance-id", name,
                 "--registry", registry, "--session-store", store, "--log-level", "warning"],
                root / f"{name}.log", url=f"http://127.0.0.1:{port}")


def gateway(root: Path, name: str, *, store: str, registry: str) -> Proc:
    return Proc(["gateway", "--port", str(free_port()), "--registry", registry,
                 "--policy", "round_robin", "--session-routing", "hybrid", "--session-store", store,
                 "--health-check-interval-s", "0.2", "--max-retries", "3",
                 "--log-level", "warning"], root / f"{name}.log")


def num_routable(gateway_url: str) -> int:
    try:
        listed = httpx.get(f"{gateway_url}/admin/instances", timeout=2).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(1 for i in listed if not i.get("ejected") and i.get("state", "ready") == "ready")


def is_routable(gateway_url: str, num: int) -> bool:
    return num_routable(gateway_url) == num


def chat(url: str, messages: list[dict[str, str]], session: str | None = None) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                      timeout=REQUEST_TIMEOUT_S)


def user_message(n: int) -> dict[str, str]:
    return {"role": "user", "content": f"turn {n}: tell me the next thing"}


def reference_run(url: str) -> list[tuple[str, int]]:
    """(answer, prompt_tokens) per turn: the full history sent explicitly to one instance."""
    history: list[dict[str, str]] = []
    answers = []
    for n in range(NUM_TURNS):
        history.append(user_message(n))
        response = chat(url, history)
        assert response.status_code == 200, response.text
        body = response.json()
        text = body["choices"][0]["message"]["content"]
        history.append({"role": "assistant", "content": text})
        answers.append((text, body["usage"]["prompt_tokens"]))
    return answers


@dataclass
class Fleet:
    redis: RedisServer
    instances: dict[str, Proc] = field(default_factory=dict)
    gateways: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        for proc in [*self.gateways, *self.instances.values()]:
            proc.kill()
        self.redis.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    model_dir = make_tiny_model_dir(tmp_path / "tiny", initializer_range=0.2,
                                    max_position_embeddings=1024, torch_dtype="float32")
    running = Fleet(RedisServer(tmp_path / "redis"))
    try:
        running.redis.start()
        registry = f"sqlite:///{tmp_path}/registry.db"
        for k in range(3):
            running.instances[f"inst-{k}"] = serve(tmp_path, model_dir, f"inst-{k}",
                                                   store=running.redis.url, registry=registry)
        running.gateways = [gateway(tmp_path, f"gw-{k}", store=running.redis.url,
                                    registry=registry) for k in range(2)]
        for proc in [*running.instances.values(), *running.gateways]:
            proc.spawn()  # all at once: the starts overlap
        for proc in [*running.instances.values(), *running.gateways]:
            proc.wait_ready()
        for gw in running.gateways:
            wait_until(partial(is_routable, gw.url, 3), 30, "3 instances in a gateway")
        yield running
    finally:
        running.stop()


def test_every_turn_sees_the_whole_history_while_each_answering_instance_is_killed(
        fleet: Fleet) -> None:
    reference = reference_run(fleet.instances["inst-0"].url)
    restarting: Proc | None = None
    answered_by = []
    for n in range(NUM_TURNS):
        response = chat(fleet.gateways[n % 2].url, [user_message(n)], session="story")
        assert response.status_code == 200, (n, response.text)
        body = response.json()
        assert (body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]) \
            == reference[n], f"turn {n}"
        assert response.headers["x-session-revision"] == str(n + 1)
        assert response.headers["x-strata-session-truncated"] == "0"
        victim = fleet.instances[response.headers["x-strata-instance"]]
        answered_by.append(response.headers["x-strata-instance"])
        if restarting is not None and restarting is not victim:
            restarting.wait_ready()  # never two down at once
        victim.kill()
        victim.spawn()  # same port and instance id
        restarting = victim
    assert len(set(answered_by)) >= 2  # the conversation really moved
    stored = httpx.get(f"{fleet.gateways[0].url}/v1/sessions/story", timeout=10).json()
    assert [m["content"] for m in stored["messages"][1::2]] == [a for a, _ in reference]


def test_acknowledged_turns_survive_a_redis_crash(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "tiny", initializer_range=0.2,
                                    max_position_embeddings=4096, torch_dtype="float32")
    redis = RedisServer(tmp_path / "redis", extra_args=["--appendonly", "yes",
                                                        "--appendfsync", "always"])
    running = Fleet(redis)
    try:
        redis.start()
        registry = f"sqlite:///{tmp_path}/registry.db"
        running.instances["inst-0"] = serve(tmp_path, model_dir, "inst-0", store=redis.url,
                                            registry=registry)
        running.gateways = [gateway(tmp_path, "gw-0", store=redis.url, registry=registry)]
        for proc in [*running.instances.values(), *running.gateways]:
            proc.spawn()
        for proc in [*running.instances.values(), *running.gateways]:
            proc.wait_ready()
        wait_until(lambda: num_routable(running.gateways[0].url) == 1, 30, "the instance")
        acked, failed = run_turns_across_a_crash(running.gateways[0].url, redis)
        assert failed, "no turn overlapped the crash: the story did not happen"
        stored = httpx.get(f"{running.instances['inst-0'].url}/v1/sessions/crash",
                           timeout=10).json()["messages"]
        assert_history_holds(stored, acked)
    finally:
        running.stop()


def run_turns_across_a_crash(url: str, redis: RedisServer) -> tuple[dict[str, str], list[int]]:
    """Turns back to back; Redis is killed after 3 acknowledged turns and restarted OUTAGE_S later.
    Returns {user message: answer} of the acknowledged turns and the numbers of failed turns."""
    acked: dict[str, str] = {}
    failed: list[int] = []
    crashed = threading.Event()

    def crash() -> None:
        redis.stop(kill=True)
        time.sleep(OUTAGE_S)  # longer than the store client's retries
        redis.start()

    crasher = threading.Thread(target=crash, daemon=True)
    deadline = time.monotonic() + 90
    n = 0
    while time.monotonic() < deadline and (not crashed.is_set() or crasher.is_alive()
                                           or len(acked) < 6):
        message = {"role": "user", "content": f"message {n}"}
        response = post_turn(url, message)
        if response is not None and response.status_code == 200:
            acked[message["content"]] = response.json()["choices"][0]["message"]["content"]
        else:
            failed.append(n)
            time.sleep(0.1)
        if len(acked) == 3 and not crashed.is_set():
            crashed.set()
            crasher.start()
        n += 1
    crasher.join(timeout=30)
    return acked, failed


def post_turn(url: str, message: dict[str, str]) -> httpx.Response | None:
    try:
        return chat(url, [message], session="crash")
    except httpx.HTTPError:
        return None


def assert_history_holds(stored: list[dict[str, Any]], acked: dict[str, str]) -> None:
    """Whole turns only (user then assistant), every acknowledged turn present with its answer,
    in the order sent."""
    assert len(stored) % 2 == 0, stored
    users, answers = stored[0::2], stored[1::2]
    assert all(m["role"] == "user" for m in users) and all(m["role"] == "assistant"
                                                           for m in answers), stored
    turns = {u["content"]: a["content"] for u, a in zip(users, answers, strict=True)}
    assert {u: turns.get(u) for u in acked} == acked  # zero acknowledged turns lost
    order = [u["content"] for u in users]
    assert [u for u in order if u in acked] == list(acked)
