from __future__ import annotations

import pytest

from strata.engine.block_pool import BlockPool
from strata.types import BlockHash


def test_new_blocks_come_from_the_head_in_id_order() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3]


def test_freed_blocks_queue_in_given_order_and_are_reused_lru() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a])
    assert pool.free_queue.block_ids() == [3, 2, 0]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [3, 2]


def test_cached_block_is_evicted_when_reused_and_survives_until_then() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, BlockHash(b"h-a"), (1, 2))
    pool.free_blocks([a])
    assert pool.lookup(BlockHash(b"h-a"), (1, 2)) is a  # still cached while free
    assert pool.lookup(BlockHash(b"h-a"), (9, 9)) is None  # verified against tokens
    (reused,) = pool.get_new_blocks(1)
    assert reused is a and not a.is_cached
    assert pool.lookup(BlockHash(b"h-a"), (1, 2)) is None
    assert pool.num_evictions == 1


def test_touch_takes_a_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, BlockHash(b"h"), (1,))
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2 and a not in pool.free_queue


def test_overdraw_and_double_free_raise_with_the_invariant_name() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="Cannot get 3 free blocks"):
        pool.get_new_blocks(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="ref_cnt_non_negative"):
        pool.free_blocks([a])
