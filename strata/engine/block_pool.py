"""KV blocks, their reference counts and the free-block LRU queue.

A block is in exactly one of three states:
- in use:  ref_cnt > 0 (held by one or more running requests);
- cached:  ref_cnt == 0 with a block hash: in the free queue, but its KV can still be reused
           by a prefix hit until it is evicted;
- free:    ref_cnt == 0 without a hash.
Free and cached blocks sit in one queue ordered by when they were freed; allocation takes from the
head, so the least recently freed cached block is evicted first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from strata.types import BlockHash


class BlockListener(Protocol):
    """Told, on the engine thread, of every hash the prefix cache gains or loses
    (strata/engine/block_events.py keeps them for the gateway's prefix index)."""

    def block_cached(self, block_hash: BlockHash) -> None: ...

    def block_evicted(self, block_hash: BlockHash) -> None: ...


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # the tokens whose KV the block holds, to verify hits
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.is_cached})"

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class FreeBlockQueue:
    """A doubly linked list of blocks with O(1) append, pop from the head and removal."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("free_queue_not_empty: popleft on an empty free-block queue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"free_queue_membership: {block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def block_ids(self) -> list[int]:
        """Block ids from head (next to be reused) to tail."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every block; hands out new ones and keeps the hash -> cached block map."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.listener: BlockListener | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable cached ones)."""
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"Cannot get {num_blocks} free blocks from the pool ({self.num_free_blocks} free)"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; blocks are queued in the given order (evicted first = first given)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"ref_cnt_non_negative: {block} freed more than taken")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block
        if self.listener is not None:
            self.listener.block_cached(block_hash)

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None  # a hash collision is treated as a miss
        return block

    def reset_cache(self) -> int:
        """Forget every cached block that no request holds; returns how many."""
        dropped = [b for b in self.cached.values() if b.ref_cnt == 0]
        for block in dropped:
            self._evict(block)
        return len(dropped)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.listener is not None:
                self.listener.block_evicted(block.block_hash)
        block.block_hash, block.token_ids = None, ()
        self.num_evictions += 1
