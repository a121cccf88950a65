from __future__ import annotations

from engine_fakes import make_request, prompt_of

from strata.engine.config import CacheConfig
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.prefix_cache import hash_block, hash_blocks
from strata.engine.request import Request


def _compute(kv: KVCacheManager, request: Request) -> None:
    """Allocate and 'compute' the whole prompt, as one scheduler step would."""
    computed = kv.get_computed_blocks(request)
    request.num_computed_tokens = computed.num_tokens
    assert kv.allocate_slots(request, request.num_tokens_to_compute, computed)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_hash_chain_depends_on_parent_tokens_and_namespace() -> None:
    h1 = hash_block(None, [1, 2], "m@1")
    assert h1 == hash_block(None, [1, 2], "m@1")
    assert h1 != hash_block(None, [1, 2], "m@2")
    assert h1 != hash_block(None, [2, 1], "m@1")
    assert hash_block(h1, [3, 4], "m@1") != hash_block(None, [3, 4], "m@1")
    assert hash_blocks([1, 2, 3, 4, 5], 2, "m@1") == [h1, hash_block(h1, [3, 4], "m@1")]


def test_prefix_hit_story_with_exact_block_ids() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=8, namespace="m@1"))
    a = make_request(prompt_of(10))  # 2 full blocks + 2 tokens
    _compute(kv, a)
    assert kv.block_ids(a.request_id) == [0, 1, 2]
    b = make_request(prompt_of(10)[:8] + [5, 5, 5])
    hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 8
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 3, hit)
    assert kv.block_ids(b.request_id) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    # tails are queued before heads, so the shared prefix is evicted last
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    kv.check_integrity()


def test_a_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=8))
    a = make_request(prompt_of(8))
    _compute(kv, a)
    kv.free(a)
    again = make_request(prompt_of(8))
    assert kv.get_computed_blocks(again).num_tokens == 4


def test_salt_namespace_and_disabled_cache_miss() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=8, namespace="m@1"))
    _compute(kv, make_request(prompt_of(9)))
    assert kv.get_computed_blocks(make_request(prompt_of(9), cache_salt="tenant")).num_tokens == 0
    other = KVCacheManager(CacheConfig(block_size=4, num_blocks=8, namespace="m@2"))
    other.pool = kv.pool  # same blocks, other model version: never a hit
    assert other.get_computed_blocks(make_request(prompt_of(9))).num_tokens == 0
    off = KVCacheManager(CacheConfig(block_size=4, num_blocks=8, enable_prefix_caching=False))
    _compute(off, make_request(prompt_of(9)))
    assert off.get_computed_blocks(make_request(prompt_of(9))).num_tokens == 0
    assert not off.pool.cached


def test_allocation_fails_cleanly_when_out_of_blocks() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=3))
    big = make_request(prompt_of(13))
    assert not kv.allocate_slots(big, 13)
    assert kv.block_ids(big.request_id) == []
    assert kv.pool.num_free_blocks == 3
    kv.check_integrity()


def test_lru_eviction_order_of_cached_blocks() -> None:
    kv = KVCacheManager(CacheConfig(block_size=2, num_blocks=4))
    a, b = make_request([1, 2, 9]), make_request([3, 4, 9])
    _compute(kv, a)
    _compute(kv, b)
    kv.free(a)  # a's blocks: tail (1) then head (0)
    kv.free(b)  # then b's: tail (3) then head (2)
    c = make_request([7, 7, 7, 7, 7])  # needs 3 blocks: evicts 1, 0, 3 in that order
    assert kv.allocate_slots(c, 5)
    assert kv.block_ids(c.request_id) == [1, 0, 3]
    assert kv.get_computed_blocks(make_request([3, 4, 9])).num_tokens == 2  # b's head survived
    assert kv.get_computed_blocks(make_request([1, 2, 9])).num_tokens == 0
    kv.check_integrity()
