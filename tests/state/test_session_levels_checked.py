"""Each session consistency level's guarantee, checked on a recorded history (Jepsen-style,
tests/harness/session_history.py): concurrent writers on shared sessions through two
"instances" over one real redis-server (append-only file, fsync always), SIGKILLed and restarted
under them; the kill verified as applied (another process, operations failed meanwhile).

    strong    instances race on shared sessions: 0 acknowledged turns lost
    session   sessions pinned to an instance, written behind: read-your-writes on it, 0 lost
    eventual  written behind, read on the other instance: it misses at most the queue's turns,
              and once the store is back every acknowledged turn is there (0 lost)

Each level is checked twice: across the Redis kill, and across a partition that cuts one
instance from the store (a loopback proxy resets its connections) while the other writes on.
The long form (more writers, several kills, an instance crash) is bench/session_levels.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from harness import session_history as jepsen
from harness.tcp_proxy import ChaosProxy
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


FAULTS = ("kill", "partition")


def check_level(server: RedisServer, level: str, workload: jepsen.Workload,
                max_pending: int = 1024, fault: str = "kill"
                ) -> tuple[jepsen.History, jepsen.Fault, dict[str, list[str]]]:
    """Run `workload` at `level` through two instances with the fault in the middle (a Redis
    kill, or instance 0 cut from Redis); the history, the fault and each session's final
    messages (read after the instances closed)."""
    prefix = server.url
    proxy = ChaosProxy(server.port).start() if fault == "partition" else None

    async def main() -> tuple[jepsen.History, jepsen.Fault, dict[str, list[str]]]:
        await _flushdb(prefix)
        urls = [f"redis://127.0.0.1:{proxy.port}/0" if proxy else prefix, prefix]
        stores: list[SessionStore] = [
            create_session_store(url, consistency=level, flush_bound_s=0.5,
                                 max_pending=max_pending) for url in urls]

        async def apply(history: jepsen.History) -> jepsen.Fault:
            if proxy is None:
                return await jepsen.kill_redis(server, history)
            return await jepsen.partition_store(proxy, history, 0, len(stores))
        history, applied = await jepsen.run_with_fault(stores, workload, apply, before_s=0.4,
                                                       after_s=0.6)
        for store in stores:
            await store.close()  # a write-behind flushes first
        reader = create_session_store(prefix)
        final = await jepsen.final_histories(reader, SESSIONS)
        await reader.close()
        return history, applied, final

    try:
        return asyncio.run(main())
    finally:
        if proxy is not None:
            proxy.stop()


async def _flushdb(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    await client.aclose()


@pytest.mark.parametrize("fault_kind", FAULTS)
def test_strong_loses_no_acknowledged_turn_across_a_fault(aof_redis: RedisServer,
                                                          fault_kind: str) -> None:
    history, fault, final = check_level(aof_redis, "strong", jepsen.Workload(is_pinned=False),
                                        fault=fault_kind)
    assert fault.is_applied, fault
    acked = history.acked()
    assert len(acked) >= 20 and any(op.error == "SessionConflictError" for op in history.ops)
    assert jepsen.lost_turns(history, final) == []
    assert sum(len(v) for v in final.values()) >= len(acked)
    assert jepsen.read_your_writes_violations(history) == []


@pytest.mark.parametrize("fault_kind", FAULTS)
def test_session_level_reads_its_own_writes_through_the_pinned_instance(
        aof_redis: RedisServer, fault_kind: str) -> None:
    history, fault, final = check_level(aof_redis, "session", jepsen.Workload(is_pinned=True),
                                        fault=fault_kind)
    assert fault.is_applied, fault
    assert len(history.acked()) >= 20
    assert jepsen.read_your_writes_violations(history) == []
    assert jepsen.lost_turns(history, final) == []


@pytest.mark.parametrize("fault_kind", FAULTS)
def test_eventual_level_misses_at_most_its_queue_elsewhere_and_converges(
        aof_redis: RedisServer, fault_kind: str) -> None:
    max_pending = 16
    history, fault, final = check_level(
        aof_redis, "eventual", jepsen.Workload(is_pinned=True, cross_reads=True),
        max_pending=max_pending, fault=fault_kind)
    assert fault.is_applied, fault
    stale = jepsen.staleness(history)
    print(f"eventual: {stale}, kill {fault}")
    assert stale.num_reads >= 20 and stale.max_missed_turns <= max_pending
    assert any(op.error == "SessionStoreUnavailableError" and op.kind == "append"
               for op in history.ops)  # the full queue refused turns rather than drop them
    assert jepsen.lost_turns(history, final) == []
