"""The `session` level across a gateway SIGKILL, checked on a recorded history (issue 33).

Real processes: a Redis (append-only file, fsync always), two simulated instances whose session
history is written behind (`--session-consistency session`) and one gateway pinning sessions
(`--session-routing hybrid`, pins in its memory: a kill loses them all). Six clients each hold a
conversation, one turn after the other, sending only the new message with `X-Session-Id`; every
turn is recorded with its start, its end and the revision acknowledged (`X-Session-Revision`).
Mid-run the gateway is SIGKILLed and restarted on its port once a turn failed for it; the
restarted gateway places every session again. The kill is verified as applied (another process
serves, turns failed meanwhile, turns acknowledged after).

Checked on the history and on the store's final state (read after the instances drained):
    0 lost       every acknowledged turn is stored at its revision
    read your    a turn begun after another of its session was acknowledged saw it: its
    writes       revision is higher (the session's instance, old or new, had its history)
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cluster.test_sessions_failover import cli, num_routable, start_all, wait_ready
from harness.procs import Proc, wait_until
from redis_server import RedisServer

from strata.sim.profile import LatencyProfile
from strata.state.sessions import create_session_store

MODEL = "sim-levels"
NUM_SESSIONS = 6

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True, slots=True)
class Turn:
    session: str
    marker: str
    start_s: float
    end_s: float
    revision: int  # acknowledged; -1 when the turn failed
    instance: str = ""  # the instance that answered

    @property
    def is_acked(self) -> bool:
        return self.revision > 0


@dataclass
class Recorder:
    turns: list[Turn] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def converse(self, gateway: Proc, session: str) -> None:
        """One client: turns back to back until stopped (a failed turn waits 50 ms)."""
        with httpx.Client(timeout=10) as client:
            n = 0
            while not self.stop.is_set():
                marker = f"{session}-{n}"
                start_s = time.monotonic()
                revision, instance = _turn(client, gateway.url, session, marker)
                with self.lock:
                    self.turns.append(Turn(session, marker, start_s, time.monotonic(), revision,
                                           instance))
                if revision < 0:
                    time.sleep(0.05)
                n += 1

    def failed_between(self, start_s: float, end_s: float) -> int:
        return sum(1 for t in self.turns if not t.is_acked and start_s <= t.start_s <= end_s)


def _turn(client: httpx.Client, url: str, session: str, marker: str) -> tuple[int, str]:
    """The revision acknowledged (-1: failed) and the instance that answered."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": marker}], "max_tokens": 4}
    try:
        response = client.post(f"{url}/v1/chat/completions", json=body,
                               headers={"X-Session-Id": session})
    except httpx.HTTPError:
        return -1, ""
    if response.status_code != 200:
        return -1, ""
    return int(response.headers["x-session-revision"]), response.headers["x-strata-instance"]


def lost_turns(turns: list[Turn], stored: dict[str, list[str]]) -> list[Turn]:
    return [t for t in turns if t.is_acked
            and stored.get(t.session, [])[t.revision - 1:t.revision] != [t.marker]]


def unread_writes(turns: list[Turn]) -> list[tuple[Turn, Turn]]:
    """(acknowledged, later) pairs of one session where the later turn, begun after the
    acknowledgement, was acknowledged at a revision that does not follow it."""
    acked = [t for t in turns if t.is_acked]
    return [(a, b) for a in acked for b in acked
            if a.session == b.session and a.end_s <= b.start_s and b.revision <= a.revision]


async def _stored(url: str) -> dict[str, list[str]]:
    store = create_session_store(url)
    try:
        records = {f"c{k}": await store.get(f"c{k}", tenant="anonymous")
                   for k in range(NUM_SESSIONS)}
    finally:
        await store.close()
    return {s: [m["content"] for m in r.messages if m["role"] == "user"] if r else []
            for s, r in records.items()}


def test_session_level_loses_nothing_and_reads_its_writes_across_a_gateway_kill(
        tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis", extra_args=["--appendonly", "yes",
                                                        "--appendfsync", "always"])
    profile = tmp_path / "profile.json"
    LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=1.0,
                   prefill_ms_per_token=0.01, decode_ms_base=2.0, decode_ms_per_seq=0.1
                   ).save(profile)
    registry = f"sqlite:///{tmp_path}/registry.db"
    instances = [cli(tmp_path, f"inst-{k}", [
        "serve", "--simulate", str(profile), "--served-model-name", MODEL, "--instance-id",
        f"inst-{k}", "--registry", registry, "--session-store", redis.url,
        "--session-consistency", "session", "--log-level", "warning"]) for k in range(2)]
    gateway = cli(tmp_path, "gw", ["gateway", "--registry", registry, "--session-routing",
                                   "hybrid", "--health-check-interval-s", "0.2",
                                   "--log-level", "warning"])
    recorder = Recorder()
    clients = [threading.Thread(target=recorder.converse, args=(gateway, f"c{k}"), daemon=True)
               for k in range(NUM_SESSIONS)]
    try:
        redis.start()
        start_all([*instances, gateway])
        wait_until(lambda: num_routable(gateway.url) == 2, 30, "2 instances")
        for client in clients:
            client.start()
        time.sleep(1.5)
        killed_pid = gateway.pid
        kill_s = time.monotonic()
        gateway.kill()
        wait_until(lambda: recorder.failed_between(kill_s, time.monotonic()) > 0, 10,
                   "a turn failed for the gateway's kill")
        gateway.start()  # same port; every pin it held is gone
        wait_ready(gateway)
        wait_until(lambda: num_routable(gateway.url) == 2, 30, "2 instances again")
        back_s = time.monotonic()
        time.sleep(1.5)
        recorder.stop.set()
        for client in clients:
            client.join(timeout=20)
        assert gateway.pid != killed_pid
        for instance in instances:
            instance.stop()  # SIGTERM: a drain writes the queued turns first
        stored = asyncio.run(_stored(redis.url))
    finally:
        recorder.stop.set()
        for proc in [gateway, *instances]:
            proc.kill()
        redis.stop()
    turns = recorder.turns
    acked = [t for t in turns if t.is_acked]
    assert recorder.failed_between(kill_s, back_s) > 0  # the kill was seen by clients
    assert sum(1 for t in acked if t.start_s >= back_s) >= NUM_SESSIONS  # and it came back
    assert len(acked) >= 10 * NUM_SESSIONS
    moved = {t.session for t in acked if t.start_s >= back_s} & {
        s for s in {t.session for t in acked}
        if len({t.instance for t in acked if t.session == s}) > 1}
    print(f"{len(acked)} turns acknowledged, {len(turns) - len(acked)} failed, sessions on "
          f"another instance after the restart: {sorted(moved)}")
    assert lost_turns(turns, stored) == []
    assert unread_writes(turns) == []
