"""Redis killed (SIGKILL) and restarted mid-run with `--appendonly yes --appendfsync always`: no
acknowledged turn is lost, and the store's client reconnects by itself.

The guarantee shown is for a crash of the Redis process: the kernel keeps what Redis wrote
before it replied, so `appendfsync everysec` or `no` would pass as well, and `--appendonly no`
fails. A crash of the machine (what the fsync of `always` is for) is not simulated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
from redis_server import RedisServer

from strata.errors import SessionConflictError, SessionStoreUnavailableError
from strata.state import SessionStore, create_session_store

KILL_AFTER = 20  # turns acknowledged before the SIGKILL
TURNS_AFTER_RESTART = 20
TENANT = "t"


async def _append_turn(store: SessionStore, turn: int) -> bool:
    """One turn with read-modify-CAS; True once acknowledged, False if its outcome is unknown
    (the reply was lost; a later read tells whether it landed)."""
    while True:
        try:
            record = await store.get("chat", tenant=TENANT)
            if record is not None and record.messages[-1]["content"] == f"turn {turn}":
                return False  # landed, but its acknowledgement was lost
            await store.append("chat", tenant=TENANT,
                               expected_revision=record.revision if record else 0,
                               messages=[{"role": "user", "content": f"turn {turn}"}],
                               model="m", version="v", ttl_s=None)
            return True
        except (SessionStoreUnavailableError, SessionConflictError):
            await asyncio.sleep(0.05)


async def _run(server: RedisServer) -> tuple[list[int], list[str]]:
    """Write turns; after KILL_AFTER a thread kills and restarts Redis while the writer goes
    on; it stops TURNS_AFTER_RESTART turns after the restart completed."""
    store = create_session_store(server.url)
    acknowledged: list[int] = []
    killer: asyncio.Future[None] | None = None
    num_after_restart, turn = 0, 0
    try:
        while num_after_restart < TURNS_AFTER_RESTART:
            if turn == KILL_AFTER:
                killer = asyncio.ensure_future(asyncio.to_thread(server.restart, kill=True))
            if await _append_turn(store, turn):
                acknowledged.append(turn)
            num_after_restart += killer is not None and killer.done()
            turn += 1
        record = await store.get("chat", tenant=TENANT)
    finally:
        await store.close()
    assert record is not None
    return acknowledged, [m["content"] for m in record.messages]


def test_redis_sigkill_mid_run_loses_no_acknowledged_turn(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", extra_args=["--appendonly", "yes",
                                                         "--appendfsync", "always"])
    server.start()
    try:
        acknowledged, history = asyncio.run(_run(server))
        restarted_history = asyncio.run(_history_after_another_kill(server))
    finally:
        server.stop()
    num_turns = len(history)
    assert num_turns >= KILL_AFTER + TURNS_AFTER_RESTART
    assert history == [f"turn {t}" for t in range(num_turns)]  # every turn, in order, once
    assert set(acknowledged) <= set(range(num_turns))
    assert len(acknowledged) >= num_turns - 1  # only the turn in flight at the kill may be unsure
    assert restarted_history == history


async def _history_after_another_kill(server: RedisServer) -> list[str]:
    await asyncio.to_thread(server.restart, kill=True)
    store = create_session_store(server.url)
    try:
        record = await store.get("chat", tenant=TENANT)
    finally:
        await store.close()
    return [m["content"] for m in record.messages] if record else []


def test_the_store_turns_on_appendfsync_always_when_asked(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")  # started with --appendonly no
    server.start()
    try:
        async def write() -> None:
            store = create_session_store(server.url, redis_appendfsync="always")
            try:
                await store.append("s", tenant=TENANT, expected_revision=0, messages=[],
                                   model="m", version="v", ttl_s=None)
            finally:
                await store.close()

        asyncio.run(write())
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
    finally:
        server.stop(kill=True)  # a SIGTERM would wait for the AOF rewrite that CONFIG started
