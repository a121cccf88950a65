"""Identifiers and small vocabularies shared by every layer, and the one function that names a
KV block.

A block's identity is a hash chain over full blocks, namespaced by model, version and cache salt:

    h_i = H(h_{i-1}, tokens of block i, namespace)

It lives here, below every layer, because the engine's prefix cache, the gateway's prefix index
and the external KV store must compute exactly the same bytes (strata/engine/prefix_cache.py
explains the chain; the gateway may not import the engine).
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

RequestId = NewType("RequestId", str)
BlockHash = NewType("BlockHash", bytes)
KVPayload = bytes | bytearray  # one block's KV (strata/model/kv_codec.py); a bytearray is a
# decode instance's reused copy of a block read from shared memory (strata/server/pd/shm.py)



class PriorityClass(enum.IntEnum):
    """Request priority classes and their integer values: higher = more important, at the API,
    in the gateway and in the engine (GIE's polarity). An integer priority falls in the class
    of the highest value it reaches; anything below BATCH is SHEDDABLE."""

    SHEDDABLE = -20
    BATCH = -10
    STANDARD = 0
    INTERACTIVE = 10

    @classmethod
    def of(cls, priority: int) -> PriorityClass:
        for klass in (cls.INTERACTIVE, cls.STANDARD, cls.BATCH):
            if priority >= klass:
                return klass
        return cls.SHEDDABLE

    @property
    def label(self) -> str:
        return self.name.lower()


_ROOT = BlockHash(b"\x00" * 16)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], namespace: str) -> BlockHash:
    """The identity of one full block: its parent's identity, its tokens and the namespace."""
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


__all__ = ["BlockHash", "KVPayload", "PriorityClass", "RequestId",
           "hash_block", "hash_blocks"]
