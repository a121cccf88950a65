"""Block identity: a hash chain over full blocks, namespaced by model, version and cache salt.

    h_i = H(h_{i-1}, tokens of block i, namespace)

The same function identifies a block in the engine, the gateway's prefix index and the external KV
store, so KV computed by other weights (another version) can never be reused. It is defined in
strata/types.py, the one module every layer may import (the gateway never imports the engine).
"""

from __future__ import annotations

from strata.types import hash_block, hash_blocks

__all__ = ["hash_block", "hash_blocks"]
