"""CPU kernels in C: paged decode attention, chunk attention and a fused residual-add + RMSNorm.

Paged decode attention: the torch path gathers every decode row's K and V into padded
(D, L, ...) tensors, per layer, per step, then runs a masked SDPA: three passes over the KV bytes
and a slow masked kernel. This kernel reads each cached key and value once, in place, in float32,
with OpenMP over decode rows.

The fused add + norm replaces about nine torch ops (each a pass over memory and a dispatch) with
one, keeping HF's bf16 rounding points: 3x faster than the torch ops at 32 and 512 rows.

The C source lives in `csrc/` (package data); `kernel_build` compiles and loads it at first use.
This module holds the Python wrappers. When the kernels cannot be built (no compiler, or a
compiler that fails), `supports` is false and callers use their torch paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata.model import gemm
from strata.model.kernel_build import kernel_library

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def supports(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `decode_attention` runs for tensors of this dtype on this device."""
    return (torch.device(device).type == "cpu" and dtype in _SUFFIX
            and kernel_library() is not None)


def uniform_head_start(heads: int, kv_heads: int) -> Tensor:
    """KV head g serves query heads g * G .. (g + 1) * G - 1 (G = heads / kv_heads): the
    `head_start` of a whole model, (kv_heads + 1,) int64."""
    key = (heads, kv_heads)
    if key not in _UNIFORM:
        _UNIFORM[key] = torch.arange(0, heads + 1, heads // kv_heads, dtype=torch.int64)
    return _UNIFORM[key]


_UNIFORM: dict[tuple[int, int], Tensor] = {}


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                     context_lens: Tensor, block_size: int,
                     head_start: Tensor | None = None, *, as_chunk: bool = False) -> Tensor:
    """Attention of one query row per sequence over its cached positions 0 .. len - 1.

    q: (D, heads, head_dim), rows may be strided; k_cache, v_cache: (slots, kv_heads, head_dim),
    contiguous; block_table: (D, W) int64; context_lens: (D,) int64. Returns (D, heads, head_dim).
    KV head g serves query heads head_start[g] .. head_start[g + 1] - 1 ((kv_heads + 1,) int64;
    default: even groups). Call only when `supports(q.dtype, q.device)` is true.
    `as_chunk`: compute each row as `chunk_attention` computes a one-token chunk, bit for bit
    (slower; `supports_chunk(...)` must hold), so a decoded token's KV equals its recomputation
    by a prefill (`strata serve --deterministic`).
    """
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports() first"
    d, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = head_start if head_start is not None else uniform_head_start(heads, k_cache.shape[1])
    fn = getattr(lib, f"decode_{_SUFFIX[q.dtype]}{'_lanes' if as_chunk else ''}")
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
       context_lens.data_ptr(), out.data_ptr(), starts.data_ptr(), q.stride(0), d, heads,
       k_cache.shape[1], head_dim, block_size, block_table.shape[1], head_dim ** -0.5)
    return out


def supports_chunk(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Whether `chunk_attention` runs: `supports`, and head_dim a multiple of 16, <= 256."""
    return head_dim % 16 == 0 and head_dim <= 256 and supports(dtype, device)


def decodes_keys_in_lanes(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Whether `decode_attention(as_chunk=True)` puts 16 keys in the vector lanes (bf16, head_dim
    a multiple of 32, AVX512-BF16 built in): then it runs as fast as the plain decode kernel
    (bench/decode_attention_speed.py), so decode rows take it by default, and a decoded token's
    attention is always its prefill's. Elsewhere `as_chunk` runs the chunk task with one token,
    whose 16 lanes a decoded row's few query heads leave mostly idle."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0
            and supports_chunk(dtype, device, head_dim) and gemm.supports_bf16())


def chunk_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_row: Tensor,
                    start_pos: int, block_size: int, head_start: Tensor | None = None) -> Tensor:
    """Causal attention of n new tokens of one sequence at positions start_pos .. + n - 1.

    Query i attends to the cached positions 0 .. start_pos + i (its own K/V already written),
    read in place through `block_row` (W,) int64. q: (n, heads, head_dim), rows may be strided;
    returns (n, heads, head_dim). `head_start` as for `decode_attention`. Call only when
    `supports_chunk(...)` is true.
    """
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports_chunk() first"
    n, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = head_start if head_start is not None else uniform_head_start(heads, k_cache.shape[1])
    fn = getattr(lib, f"decode_{_SUFFIX[q.dtype]}_chunk")
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_row.data_ptr(),
       out.data_ptr(), starts.data_ptr(), q.stride(0), n, start_pos, heads, k_cache.shape[1],
       head_dim, block_size, head_dim ** -0.5)
    return out


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """`x += delta` in place (when given), then RMSNorm(x) * weight, rounded as HF rounds.

    x, delta: (rows, n) contiguous of one dtype; weight: (n,). Requires `supports(x.dtype, ...)`.
    """
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports() first"
    assert x.is_contiguous() and (delta is None or delta.is_contiguous())
    out = torch.empty_like(x)
    fn = getattr(lib, f"decode_{_SUFFIX[x.dtype]}_add_rms_norm")
    fn(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
       out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out

