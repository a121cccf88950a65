"""Per-request block tables over the block pool, with automatic prefix caching.

Region map of one request's blocks (block_size B, num_computed_tokens C, num_tokens N):

    [0, C // B)            full computed blocks; registered in the prefix cache once full
    [C // B, ceil(N / B))  blocks being written this step (allocated by `allocate_slots`)

A batch in flight (pipeline parallel) holds a reference on the blocks it writes, as a request
does: a request aborted or preempted meanwhile drops its own references at once, and those
blocks return to the free queue only when the batch is collected (`hold` / `release`).

A prefix hit has two parts: blocks found in the local prefix cache, then blocks whose KV was
fetched from an external store (`Request.external_kv`). The latter get new blocks at admission,
count as computed, and are imported by the executor before the step's forward pass. At least one
prompt token is left to compute (its logits give the first token), except for a request whose
first token a prefill instance handed over (`Request.handoff`): its whole prompt may be
imported, the partial last block too (named by `hash_tokens(..., partial=True)`).

A finished request may leave the blocks of its computed tokens held for a hand-off
(`hold_finished`): the hold owns one reference on each, so they stay out of the free pool (and
full ones in the prefix cache) until `release_finished`, whoever else shares them meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from strata.engine.block_pool import BlockPool, KVBlock
from strata.engine.config import CacheConfig
from strata.engine.outputs import HeldBlocks
from strata.engine.prefix_cache import hash_block, hash_blocks
from strata.engine.request import Request
from strata.types import BlockHash, KVPayload, RequestId


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """The prefix hit of a request: its first `blocks` already hold KV; the next
    `len(external)` blocks are to be imported from fetched payloads. `num_tokens` counts both."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    external: list[KVPayload] = field(default_factory=list)


_NO_HIT = ComputedBlocks()


class KVCacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self._blocks: dict[RequestId, list[KVBlock]] = {}
        self._hashes: dict[RequestId, list[BlockHash]] = {}
        self._num_cached: dict[RequestId, int] = {}
        self._finished_holds: dict[RequestId, list[KVBlock]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0  # local prefix-cache hits
        self.num_external_hit_tokens = 0  # imported from fetched KV

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks do not count)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: RequestId) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest verified prefix hit (local, then fetched); at least one token is left to
        compute."""
        if not self.config.enable_prefix_caching:
            return _NO_HIT
        hashes = self._block_hashes(request)
        tokens = request.all_token_ids
        is_handed = request.pending_handoff is not None
        max_blocks = len(hashes) if is_handed else (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(block_hash, chunk)
            if block is None:
                break
            hits.append(block)
        external = []
        if is_handed and request.num_tokens % self.block_size:
            hashes = self.hash_tokens(tokens, request.cache_salt, request.num_public_tokens,
                                      partial=True, lora_digest=request.lora_digest)
            max_blocks = len(hashes)
        for block_hash in hashes[len(hits) : max_blocks]:
            payload = request.external_kv.get(block_hash)
            if payload is None:
                break
            external.append(payload)
        num_tokens = min((len(hits) + len(external)) * self.block_size, request.num_tokens)
        return ComputedBlocks(hits, num_tokens, external)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int,
                      num_external_tokens: int = 0) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens
        self.num_external_hit_tokens += num_external_tokens

    def record_refused_import(self, num_tokens: int) -> None:
        """Fetched tokens the executor refused: recomputed, so no longer external hits."""
        self.num_external_hit_tokens -= num_tokens

    def hash_tokens(self, token_ids: list[int], cache_salt: str, num_public_tokens: int = 0,
                    *, partial: bool = False, lora_digest: str = "") -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids`, named as this cache names them; with
        `partial`, then of the partial last block (chained the same way over its tokens).
        `lora_digest`: the LoRA adapter's content digest, part of every block's name."""
        hashes = self._hash_from(token_ids, cache_salt, num_public_tokens, None, 0, lora_digest)
        tail = token_ids[len(hashes) * self.block_size :]
        if partial and tail:
            hashes.append(hash_block(hashes[-1] if hashes else None, tail,
                                     self._namespace(cache_salt, lora_digest)))
        return hashes

    def num_cached_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading `hashes` the prefix cache holds now (not verified against tokens)."""
        num = 0
        for block_hash in hashes:
            if block_hash not in self.pool.cached:
                break
            num += 1
        return num

    def computed_block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks whose KV is computed."""
        num_full = request.num_computed_tokens // self.block_size
        return self._block_hashes(request)[:num_full]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = _NO_HIT
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after those computed or in flight; False
        (nothing changed) if out of blocks.

        `request.num_computed_tokens` already counts the hit tokens of `computed`.
        """
        if self.num_blocks_short(request, num_new_tokens, computed) > 0:
            return False
        table = self._blocks.setdefault(request.request_id, [])
        num_needed = self._num_new_blocks(request, num_new_tokens, computed)
        self.pool.touch(computed.blocks)
        table.extend(computed.blocks)
        if num_needed > 0:
            table.extend(self.pool.get_new_blocks(num_needed))
        self._num_cached.setdefault(request.request_id, len(computed.blocks))
        return True

    def num_blocks_short(self, request: Request, num_new_tokens: int,
                         computed: ComputedBlocks = _NO_HIT) -> int:
        """How many more free blocks `allocate_slots` would need to succeed (0: it would)."""
        num_revived = sum(1 for b in computed.blocks if b.ref_cnt == 0)
        num_wanted = self._num_new_blocks(request, num_new_tokens, computed) + num_revived
        return max(0, num_wanted - self.pool.num_free_blocks)

    def num_freeable(self, request: Request) -> int:
        """Blocks that would return to the free queue if `request` were freed now (those no
        other request or batch in flight holds)."""
        return sum(1 for b in self._blocks.get(request.request_id, ()) if b.ref_cnt == 1)

    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        computed: ComputedBlocks) -> int:
        num_total = request.num_computed_tokens + request.num_in_flight_tokens + num_new_tokens
        num_held = len(self._blocks.get(request.request_id, ())) + len(computed.blocks)
        return -(-num_total // self.block_size) - num_held

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that became full and computed this step."""
        if not self.config.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        tokens, blocks = request.all_token_ids, self._blocks[rid]
        for i in range(start, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache_block(blocks[i], hashes[i], chunk)
        self._num_cached[rid] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks; the tail is queued first so it is evicted first."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        self.pool.free_blocks(list(reversed(blocks)))
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)

    def hold(self, request: Request, start: int, num_tokens: int) -> list[KVBlock]:
        """Take a reference on the blocks that positions `start .. start + num_tokens` of
        `request` are written to, for the batch that writes them; `release` gives it back."""
        first, end = start // self.block_size, -(-(start + num_tokens) // self.block_size)
        blocks = self._blocks[request.request_id][first:end]
        self.pool.touch(blocks)
        return blocks

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop the references `hold` took; blocks no request holds any more are freed, the
        tail first (as `free` does)."""
        self.pool.free_blocks(list(reversed(blocks)))

    def hold_finished(self, request: Request) -> HeldBlocks:
        """Take a reference, owned by a hold, on the blocks of the request's computed tokens,
        the partial last one included (call before `free`); one hold per request id."""
        if request.request_id in self._finished_holds:
            raise RuntimeError(f"one_hold_per_request: {request.request_id} is already held")
        computed = request.all_token_ids[: request.num_computed_tokens]
        hashes = self.hash_tokens(computed, request.cache_salt, request.num_public_tokens,
                                  partial=True, lora_digest=request.lora_digest)
        blocks = self._blocks.get(request.request_id, [])[: len(hashes)]
        self.pool.touch(blocks)
        self._finished_holds[request.request_id] = blocks
        return HeldBlocks(tuple(b.block_id for b in blocks), tuple(hashes[: len(blocks)]))

    def release_finished(self, request_id: RequestId) -> int:
        """Drop the hold of a finished request (the tail is queued first, evicted first); how
        many blocks it held (0: none, e.g. already released)."""
        blocks = self._finished_holds.pop(request_id, [])
        self.pool.free_blocks(list(reversed(blocks)))
        return len(blocks)

    def held_block_ids(self, request_id: RequestId) -> list[int]:
        """The blocks the finished `request_id` holds, in order ([] once released)."""
        return [b.block_id for b in self._finished_holds.get(request_id, ())]

    @property
    def num_held_blocks(self) -> int:
        """Blocks held for finished requests (not those of batches in flight)."""
        return sum(len(blocks) for blocks in self._finished_holds.values())

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else None
            hashes.extend(self._hash_from(request.all_token_ids, request.cache_salt,
                                          request.num_public_tokens, parent, len(hashes),
                                          request.lora_digest))
        return hashes

    def _hash_from(self, token_ids: list[int], cache_salt: str, num_public_tokens: int,
                   parent: BlockHash | None, start_block: int,
                   lora_digest: str = "") -> list[BlockHash]:
        """Block hashes from `start_block` on. Blocks wholly inside the first
        `num_public_tokens` are named in the namespace every tenant shares (no salt); the rest,
        chained from them, in the salted one: a tenant's own blocks stay its own. A LoRA
        adapter's digest names both: KV computed with its weights is its own."""
        size = self.block_size
        num_public = min(num_public_tokens, len(token_ids)) // size
        hashes: list[BlockHash] = []
        if start_block < num_public:
            hashes = hash_blocks(token_ids[: num_public * size], size,
                                 self._namespace("", lora_digest), parent=parent,
                                 start_block=start_block)
            parent, start_block = hashes[-1], num_public
        return hashes + hash_blocks(token_ids, size, self._namespace(cache_salt, lora_digest),
                                    parent=parent, start_block=start_block)

    def _namespace(self, cache_salt: str, lora_digest: str = "") -> str:
        base = f"{self.config.namespace}|{cache_salt}"
        return f"{base}|lora:{lora_digest}" if lora_digest else base

    def check_integrity(self, held: Iterable[KVBlock] = ()) -> None:
        """free + cached + in use == total, and ref counts match the block tables, the holds of
        finished requests and `held` (the blocks held by batches in flight, once per hold)."""
        pool = self.pool
        refs: dict[int, int] = {}
        for b in held:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for blocks in [*self._blocks.values(), *self._finished_holds.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        in_use = cached = free = 0
        for b in pool.blocks:
            if b.ref_cnt != refs.get(b.block_id, 0):
                raise RuntimeError(
                    f"ref_cnt_matches_tables: {b} held by {refs.get(b.block_id, 0)} (tables and "
                    "batches in flight)"
                )
            if (b.ref_cnt == 0) != (b in pool.free_queue):
                raise RuntimeError(f"free_queue_holds_unreferenced: {b}")
            in_use += b.ref_cnt > 0
            cached += b.ref_cnt == 0 and b.is_cached
            free += b.ref_cnt == 0 and not b.is_cached
        if in_use + cached + free != pool.num_blocks or free + cached != pool.num_free_blocks:
            raise RuntimeError(
                f"blocks_accounted: free {free} + cached {cached} + in use {in_use} "
                f"!= total {pool.num_blocks}"
            )
        for h, b in pool.cached.items():
            if b.block_hash != h:
                raise RuntimeError(f"cache_map_consistent: {b} listed under another hash")
