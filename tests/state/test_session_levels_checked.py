"""Each session consistency level's guarantee, checked on a recorded history (Jepsen-style,
tests/harness/session_history.py): concurrent writers on shared sessions through two
"instances" over one real redis-server (append-only file, fsync always), SIGKILLed and restarted
under them; the kill verified as applied (another process, operations failed meanwhile).

    strong    instances race on shared sessions: 0 acknowledged turns lost
    session   sessions pinned to an instance, written behind: read-your-writes on it, 0 lost
    eventual  written behind, read on the other instance: it misses at most the queue's turns,
              and once the store is back every acknowledged turn is there (0 lost)

The long form (more writers, several kills, an instance crash) is bench/session_levels.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from harness import session_history as jepsen
from redis_server import RedisServer

from strata.state.sessions import SessionStore, create_session_store

SESSIONS = [f"s{i}" for i in range(jepsen.Workload().num_sessions)]


@pytest.fixture(scope="module")
def aof_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("aof-redis"),
                         extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    server.start()
    yield server
    server.stop()


def check_level(server: RedisServer, level: str, workload: jepsen.Workload,
                max_pending: int = 1024) -> tuple[jepsen.History, jepsen.RedisKill,
                                                  dict[str, list[str]]]:
    """Run `workload` at `level` through two instances with a Redis kill in the middle; the
    history, the kill and each session's final messages (read after the instances closed)."""
    prefix = server.url

    async def main() -> tuple[jepsen.History, jepsen.RedisKill, dict[str, list[str]]]:
        await _flushdb(prefix)
        stores: list[SessionStore] = [
            create_session_store(prefix, consistency=level, flush_bound_s=0.5,
                                 max_pending=max_pending) for _ in range(2)]
        history, fault = await jepsen.run_with_kill(stores, server, workload, before_s=0.4,
                                                    after_s=0.6)
        for store in stores:
            await store.close()  # a write-behind flushes first
        reader = create_session_store(prefix)
        final = await jepsen.final_histories(reader, SESSIONS)
        await reader.close()
        return history, fault, final

    return asyncio.run(main())


async def _flushdb(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    await client.aclose()


def test_strong_loses_no_acknowledged_turn_across_a_redis_kill(aof_redis: RedisServer) -> None:
    history, fault, final = check_level(aof_redis, "strong", jepsen.Workload(is_pinned=False))
    assert fault.is_applied, fault
    acked = history.acked()
    assert len(acked) >= 20 and any(op.error == "SessionConflictError" for op in history.ops)
    assert jepsen.lost_turns(history, final) == []
    assert sum(len(v) for v in final.values()) >= len(acked)
    assert jepsen.read_your_writes_violations(history) == []


def test_session_level_reads_its_own_writes_through_the_pinned_instance(
        aof_redis: RedisServer) -> None:
    history, fault, final = check_level(aof_redis, "session", jepsen.Workload(is_pinned=True))
    assert fault.is_applied, fault
    assert len(history.acked()) >= 20
    assert jepsen.read_your_writes_violations(history) == []
    assert jepsen.lost_turns(history, final) == []


def test_eventual_level_misses_at_most_its_queue_elsewhere_and_converges(
        aof_redis: RedisServer) -> None:
    max_pending = 16
    history, fault, final = check_level(
        aof_redis, "eventual", jepsen.Workload(is_pinned=True, cross_reads=True),
        max_pending=max_pending)
    assert fault.is_applied, fault
    stale = jepsen.staleness(history)
    print(f"eventual: {stale}, kill {fault}")
    assert stale.num_reads >= 20 and stale.max_missed_turns <= max_pending
    assert any(op.error == "SessionStoreUnavailableError" and op.kind == "append"
               for op in history.ops)  # the full queue refused turns rather than drop them
    assert jepsen.lost_turns(history, final) == []
