"""Block identity: a hash chain over full blocks, namespaced by model, version and cache salt.

    h_i = H(h_{i-1}, tokens of block i, namespace)

The same function identifies a block in the engine, the gateway's prefix index and the external KV
store, so KV computed by other weights (another version) can never be reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from strata.types import BlockHash

_ROOT = BlockHash(b"\x00" * 16)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], namespace: str) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else _ROOT)
    h.update(namespace.encode())
    h.update(b"\x00")
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    *,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block from `start_block` on, chained from `parent`."""
    hashes = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes
