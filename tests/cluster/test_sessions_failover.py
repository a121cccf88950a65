"""Sessions survive failures: real `strata serve` and `strata gateway` processes and a real Redis.

Story 1: two gateways (hybrid session routing, pins in Redis) and three tiny-model instances
(session store in Redis, one SQLite registry). A 4-turn greedy conversation sends only each new
user message with `X-Session-Id`, alternating gateways; the instance that answered each turn is
SIGKILLed right after it and restarted on the same port (two of three are always up). Every turn
must see the whole history (prompt_tokens of the full history) and answer exactly what one
instance answers, with no failure, when sent the full history explicitly.

Story 2, on story 1's fleet (its Redis started with `appendfsync always`): Redis is SIGKILLed
while turns flow through a gateway, and restarted once a turn has failed for it: every
acknowledged turn is in the stored history afterwards, no turn is half stored, and turns succeed
again once Redis is back.

Story 3: `strata serve --session-redis-appendfsync always` on a Redis started without an
append-only file turns one on, so acknowledged turns survive a SIGKILL of Redis.

What these prove is a crash of the Redis *process*: the kernel keeps what Redis wrote, so
`appendfsync everysec` or `no` would survive it too; a crash of the machine is not simulated.
"""

from __future__ import annotations

import re
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
import redis as redis_client
from harness import pooled_http
from harness.procs import Proc, wait_until
from redis_server import RedisServer
from tiny_models import make_tiny_model_dir

MODEL = "tiny"
MAX_TOKENS = 8
# each turn kills the instance that answered it (4 restarts, a torch import each): with three
# instances and never two down at once, turn 2 or 3 is answered by one that was restarted
NUM_TURNS = 4
START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
READY = re.compile(r"(Strata serving \S+|Strata gateway) on (http://127\.0\.0\.1:(\d+))")

pytestmark = pytest.mark.timeout(240)


def cli(root: Path, name: str, args: list[str]) -> Proc:
    """A `strata` subprocess on `--port 0` (it binds the port itself); not started yet."""
    return Proc(name, [sys.executable, "-m", "strata.cli", *args, "--port", "0"],
                root / f"{name}.log")


def wait_ready(proc: Proc, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait for its ready line, then keep its port for restarts. A restart whose port another
    process took meanwhile (it exits: address already in use) is started again, same port."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ready = proc.wait_for_output(READY, max(deadline - time.monotonic(), 0.1))
            break
        except RuntimeError:
            if not proc.lost_its_port or time.monotonic() > deadline:
                raise
            proc.start()
    proc.url = ready.group(2)
    proc.argv[proc.argv.index("--port") + 1] = ready.group(3)


def serve(root: Path, model_dir: Path, name: str, *, store: str, registry: str,
          extra: tuple[str, ...] = ()) -> Proc:
    return cli(root, name, ["serve", str(model_dir), "--served-model-name", MODEL, "--dtype",
                            "float32", "--device", "cpu", "--threads", "1", "--instance-id", name,
                            "--registry", registry, "--session-store", store, "--log-level",
                            "warning", *extra])


def gateway(root: Path, name: str, *, store: str, registry: str) -> Proc:
    return cli(root, name, ["gateway", "--registry", registry, "--policy", "round_robin",
                            "--session-routing", "hybrid", "--session-store", store,
                            "--health-check-interval-s", "0.2", "--max-retries", "3",
                            "--log-level", "warning"])


def start_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.start()  # all at once: the starts overlap
    for proc in procs:
        wait_ready(proc)


def num_routable(gateway_url: str) -> int:
    try:
        listed = pooled_http.get(f"{gateway_url}/admin/instances", timeout=2).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(1 for i in listed if not i.get("ejected") and i.get("state", "ready") == "ready")


def is_routable(gateway_url: str, num: int) -> bool:
    return num_routable(gateway_url) == num


def chat(url: str, messages: list[dict[str, str]], session: str | None = None) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return pooled_http.post(f"{url}/v1/chat/completions", json=body, headers=headers,
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


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Stories 1 and 2 on one fleet; Redis with `appendfsync always` (story 2's; story 1 is
    the same on any Redis). Each story leaves it whole, or the `fleet` fixture waits for it."""
    root = tmp_path_factory.mktemp("sessions")
    model_dir = make_tiny_model_dir(root / "tiny", initializer_range=0.2,
                                    max_position_embeddings=4096, torch_dtype="float32")
    running = Fleet(RedisServer(root / "redis", extra_args=["--appendonly", "yes",
                                                            "--appendfsync", "always"]))
    try:
        running.redis.start()
        registry = f"sqlite:///{root}/registry.db"
        for k in range(3):
            running.instances[f"inst-{k}"] = serve(root, model_dir, f"inst-{k}",
                                                   store=running.redis.url, registry=registry)
        running.gateways = [gateway(root, f"gw-{k}", store=running.redis.url,
                                    registry=registry) for k in range(2)]
        start_all([*running.instances.values(), *running.gateways])
        yield running
    finally:
        running.stop()


@pytest.fixture
def fleet(shared_fleet: Fleet) -> Fleet:
    """The module's fleet, whole: every instance up (a story's last restart ready) and
    routable in both gateways."""
    for proc in shared_fleet.instances.values():
        wait_ready(proc)
    for gw in shared_fleet.gateways:
        wait_until(partial(is_routable, gw.url, 3), 30, "3 instances in a gateway")
    return shared_fleet


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
            wait_ready(restarting)  # never two down at once
        victim.kill()
        victim.start()  # same port and instance id
        restarting = victim
    assert len(set(answered_by)) >= 2  # the conversation really moved
    assert set(answered_by[2:]) & set(answered_by[:2]), answered_by  # and met a restarted one
    stored = pooled_http.get(f"{fleet.gateways[0].url}/v1/sessions/story", timeout=10).json()
    assert [m["content"] for m in stored["messages"][1::2]] == [a for a, _ in reference]


def test_acknowledged_turns_survive_a_redis_crash(fleet: Fleet) -> None:
    with redis_client.Redis.from_url(fleet.redis.url, decode_responses=True) as client:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
    turns = run_turns_across_a_crash(fleet.gateways[0].url, fleet.redis)
    assert turns.failed, "no turn overlapped the crash: the story did not happen"
    assert len(turns.acked_after_restart) >= 3, turns  # turns succeed once Redis is back
    assert turns.outcomes[-3:] == [True, True, True], turns
    stored = pooled_http.get(f"{fleet.instances['inst-0'].url}/v1/sessions/crash",
                          timeout=10).json()["messages"]
    assert_history_holds(stored, turns.acked)


@dataclass
class CrashTurns:
    acked: dict[str, str] = field(default_factory=dict)  # user message -> answer, in order
    failed: list[int] = field(default_factory=list)
    acked_after_restart: list[int] = field(default_factory=list)
    outcomes: list[bool] = field(default_factory=list)  # per turn sent: acknowledged?


def run_turns_across_a_crash(url: str, redis: RedisServer) -> CrashTurns:
    """Turns back to back. After 3 acknowledged turns Redis is SIGKILLed; it is restarted once a
    turn has failed for it; the turns go on until 3 in a row are acknowledged after the restart
    (bounded)."""
    turns = CrashTurns()
    a_turn_failed, restarted = threading.Event(), threading.Event()

    def crash() -> None:
        redis.stop(kill=True)
        a_turn_failed.wait(timeout=60)  # the outage is seen by a client before it ends
        redis.start()
        restarted.set()

    crasher = threading.Thread(target=crash, daemon=True)
    deadline = time.monotonic() + 90
    n = 0
    while time.monotonic() < deadline and not (restarted.is_set()
                                               and turns.outcomes[-3:] == [True] * 3):
        was_back = restarted.is_set()
        message = {"role": "user", "content": f"message {n}"}
        response = post_turn(url, message)
        is_acked = response is not None and response.status_code == 200
        turns.outcomes.append(is_acked)
        if response is not None and is_acked:
            turns.acked[message["content"]] = response.json()["choices"][0]["message"]["content"]
            if was_back:
                turns.acked_after_restart.append(n)
        else:
            turns.failed.append(n)
            if crasher.is_alive():
                a_turn_failed.set()
            time.sleep(0.1)  # pacing while Redis is down, not ordering
        if len(turns.acked) == 3 and not crasher.is_alive() and not restarted.is_set():
            crasher.start()
        n += 1
    a_turn_failed.set()
    crasher.join(timeout=30)
    return turns


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


def aof_is_written(url: str) -> bool:
    """The append-only file is on and holds the dataset (Redis turns AOF on at run time by
    rewriting the dataset into a new file first; until then writes are in memory only)."""
    with redis_client.Redis.from_url(url, decode_responses=True) as client:
        info = client.info("persistence")
    return (info["aof_enabled"] == 1 and info["aof_rewrite_in_progress"] == 0
            and info["aof_rewrite_scheduled"] == 0)


def test_the_appendfsync_flag_keeps_turns_across_a_crash_of_a_redis_started_without_aof(
        tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "tiny", initializer_range=0.2,
                                    max_position_embeddings=1024, torch_dtype="float32")
    redis = RedisServer(tmp_path / "redis")  # --appendonly no: nothing would survive a crash
    instance = serve(tmp_path, model_dir, "inst-0", store=redis.url,
                     registry=f"sqlite:///{tmp_path}/registry.db",
                     extra=("--session-redis-appendfsync", "always"))
    try:
        redis.start()
        start_all([instance])
        first = chat(instance.url, [user_message(0)], session="durable")
        assert first.status_code == 200, first.text
        with redis_client.Redis.from_url(redis.url, decode_responses=True) as client:
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
        wait_until(partial(aof_is_written, redis.url), 30, "the append-only file")
        for n in range(1, 4):
            assert chat(instance.url, [user_message(n)], session="durable").status_code == 200
        # CONFIG SET lasts as long as the process: a restarted redis-server reads its own
        # configuration, which keeps appendonly yes (the README tells operators so)
        redis.extra_args += ["--appendonly", "yes"]
        redis.restart(kill=True)
        after = chat(instance.url, [user_message(4)], session="durable")
        assert after.status_code == 200, after.text
        assert after.headers["x-session-revision"] == "5"
        stored = pooled_http.get(f"{instance.url}/v1/sessions/durable",
                              timeout=10).json()["messages"]
        assert [m["content"] for m in stored[0::2]] == [user_message(n)["content"]
                                                       for n in range(5)]
    finally:
        instance.kill()
        redis.stop()
