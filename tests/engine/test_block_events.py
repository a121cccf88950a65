"""Stories of the block event log over a real KVCacheManager: what the engine caches and evicts
reaches the log in numbered batches of net changes, with snapshots at first and after an
overflow, and the mirror always equals the prefix cache."""

from __future__ import annotations

from strata.engine.block_events import BlockChanges, BlockEventLog, watch_blocks
from strata.engine.config import CacheConfig
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.request import Request, SamplingParams
from strata.types import BlockHash, RequestId, hash_blocks

BLOCK = 4


def manager(num_blocks: int = 6) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BLOCK, num_blocks=num_blocks, namespace="m@v"))


def run_prompt(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """Admit, compute and finish a prompt: its full blocks end up cached and freed."""
    request = Request(RequestId(rid), tokens, SamplingParams(max_tokens=1))
    computed = kv.get_computed_blocks(request)
    request.num_computed_tokens = computed.num_tokens
    assert kv.allocate_slots(request, len(tokens) - computed.num_tokens, computed)
    request.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(request)
    kv.free(request)
    return request


def hashes(tokens: list[int]) -> list[BlockHash]:
    return hash_blocks(tokens, BLOCK, "m@v|")


def test_first_take_is_a_snapshot_then_batches_of_net_changes() -> None:
    kv = manager()
    log = watch_blocks(kv)
    run_prompt(kv, "a", list(range(9)))  # two full blocks
    first = log.take()
    assert first == BlockChanges(1, tuple(hashes(list(range(9)))), (), is_snapshot=True)
    assert log.take() is None  # nothing changed since
    run_prompt(kv, "b", [50, 51, 52, 53, 54])  # one more block
    assert log.take() == BlockChanges(2, tuple(hashes([50, 51, 52, 53])), ())
    kv.check_integrity()


def test_eviction_reaches_the_log_and_the_mirror_follows_the_cache() -> None:
    kv = manager(num_blocks=4)
    log = watch_blocks(kv)
    log.take()
    run_prompt(kv, "a", list(range(12)))  # three blocks, all cached, all free
    assert log.take() == BlockChanges(2, tuple(hashes(list(range(12)))), ())
    run_prompt(kv, "b", [90 + i for i in range(9)])  # three new blocks: evicts two of a's
    batch = log.take()
    assert batch is not None and not batch.is_snapshot
    a = hashes(list(range(12)))
    # the tail of a request is freed first, so evicted first: a's last two blocks go
    assert set(batch.removed) == {a[2], a[1]}
    assert set(batch.stored) == set(hashes([90 + i for i in range(9)]))
    assert set(log.snapshot().stored) == set(kv.pool.cached)
    assert log.num_cached == len(kv.pool.cached)


def test_a_hash_cached_then_evicted_within_one_batch_is_net_removed() -> None:
    log = BlockEventLog()
    log.take()
    h = BlockHash(b"h" * 16)
    log.block_cached(h)
    log.block_evicted(h)
    assert log.take() == BlockChanges(2, (), (h,))
    log.block_evicted(h)  # evicted again is harmless
    log.block_cached(h)
    assert log.take() == BlockChanges(3, (h,), ())


def test_overflow_drops_pending_changes_with_a_counter_and_resends_a_snapshot() -> None:
    log = BlockEventLog(max_pending=3)
    log.take()
    keys = [BlockHash(bytes([i]) * 16) for i in range(5)]
    for key in keys[:3]:
        log.block_cached(key)
    log.block_evicted(keys[0])  # already pending: still within the bound
    log.block_cached(keys[3])  # the fourth distinct hash overflows
    log.block_cached(keys[4])  # while overflowed, nothing more is pending
    assert log.num_dropped == 4 and log.num_overflows == 1
    assert log.take() == BlockChanges(2, tuple(keys[1:]), (), is_snapshot=True)
    log.block_evicted(keys[4])
    assert log.take() == BlockChanges(3, (), (keys[4],))


def test_snapshot_between_batches_keeps_pending_changes_for_the_next_batch() -> None:
    log = BlockEventLog()
    log.take()
    a, b = BlockHash(b"a" * 16), BlockHash(b"b" * 16)
    log.block_cached(a)
    assert log.snapshot() == BlockChanges(1, (a,), (), is_snapshot=True)
    log.block_cached(b)
    assert log.take() == BlockChanges(2, (a, b), ())


def test_watch_blocks_starts_from_what_the_pool_already_caches() -> None:
    kv = manager()
    run_prompt(kv, "a", list(range(8)))
    log = watch_blocks(kv)
    assert log.take() == BlockChanges(1, tuple(hashes(list(range(8)))), (), is_snapshot=True)
    kv.reset_prefix_cache()
    batch = log.take()
    assert batch is not None and set(batch.removed) == set(hashes(list(range(8))))
    assert log.num_cached == 0
