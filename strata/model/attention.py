"""Attention over the paged KV cache: the per-step batch layout and the attention paths.

Decode rows (one new token each) use the C decode kernel of `cpu_kernels` when it is built, else
a padded gather + masked SDPA. Prefill chunks use the C chunk kernel when it is built (the
executor then gives each a `block_row`): it reads the cache in place, as the chunk's rows would
as decode queries, but each key once per tile of queries. Without it (GPU, no compiler) a chunk
that starts at position 0 attends only to itself (causal SDPA) and a later chunk (chunked
prefill, prefix-cache hit) gathers its context and runs two batched matmuls when short, SDPA
when long.

Query heads read KV heads by `HeadGroups`: even groups in a whole model, possibly uneven on a
tensor-parallel rank (see strata.model.shard); the torch paths then expand K and V to one KV
head per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from strata.model import cpu_kernels
from strata.model.config import ModelConfig
from strata.model.determinism import is_deterministic

_MATMUL_ATTENTION_MAX_ROWS = 64  # measured: SDPA is faster for longer chunks


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Rows `start:end` of the step are consecutive new tokens of one sequence from `start_pos`.

    With `block_row` (the sequence's block-table row) the C chunk kernel reads the cache in place
    and `context_slots` and `mask` are None. Otherwise, when the chunk starts at position 0 it
    attends only to itself (`context_slots` is None); else `context_slots` holds the slots of
    positions 0 .. start_pos + n and `mask[i, j]` is true when key j is at or before query i's
    position.
    """

    start: int
    end: int
    context_slots: Tensor | None
    mask: Tensor | None
    start_pos: int = 0
    block_row: Tensor | None = None


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Per-step indices for one forward. Rows 0 .. num_decodes are decode rows."""

    input_ids: Tensor  # (T,)
    positions: Tensor  # (T,)
    slot_mapping: Tensor  # (T,) where each new token's K/V is written
    num_decodes: int
    decode_block_table: Tensor  # (D, W) block ids of each decode row (padding never read)
    decode_context_lens: Tensor  # (D,) positions each decode row attends to: 0 .. len - 1
    prefills: list[PrefillChunk]
    sample_rows: Tensor  # (S,) rows whose logits are returned
    block_size: int


@dataclass(frozen=True, slots=True)
class HeadGroups:
    """KV head g serves query heads start[g] .. start[g + 1] - 1.

    `start` (kv_heads + 1,) int64 stays on the CPU for the C kernels; `kv_of_head` (heads,) is
    set only for uneven groups, for the torch paths' expansion of K and V.
    """

    start: Tensor
    kv_of_head: Tensor | None

    @staticmethod
    def of(head_start: tuple[int, ...], device: torch.device | str) -> HeadGroups:
        start = torch.tensor(head_start, dtype=torch.int64)
        sizes = {b - a for a, b in zip(head_start, head_start[1:], strict=False)}
        if len(sizes) == 1:
            return HeadGroups(start, None)
        kv_of_head = torch.repeat_interleave(torch.arange(len(head_start) - 1),
                                             start.diff()).to(device)
        return HeadGroups(start, kv_of_head)

    def expand(self, kv: Tensor, dim: int) -> Tensor:
        """K or V with one head per query head along `dim` (as is for even groups)."""
        return kv if self.kv_of_head is None else kv.index_select(dim, self.kv_of_head)


class PagedKVCache:
    """K and V of every layer, addressed by slot = block_id * block_size + offset.

    Invariant: slot `null_slot` (one past the last block) stays all zeros; padded gathers point at
    it, so a masked position never reads garbage (NaN times a zero weight is still NaN).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str, *, num_layers: int | None = None,
                 kv_heads: int | None = None) -> None:
        """`num_layers` and `kv_heads` default to the whole model's (a rank holds fewer)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_slot = num_blocks * block_size
        shape = (num_layers or config.num_hidden_layers, 2, self.null_slot + 1,
                 kv_heads or config.num_key_value_heads, config.head_dim)
        self.data = torch.empty(shape, dtype=dtype, device=device)
        self.data[:, :, self.null_slot].zero_()

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """The (K, V) tensors of one layer, each (num_slots + 1, kv_heads, head_dim)."""
        return self.data[index, 0], self.data[index, 1]


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How this step's decode rows read the cache: the C kernel, or a padded torch gather.

    The torch path's `slots` (D, L) are padded with the cache's null slot and `mask` (D, 1, 1, L)
    is true where a row attends; both are built once per step, not per layer. `as_chunk`: the
    C kernel computes each row as the chunk kernel computes a prefill's, so a recomputed prefix
    gives the decoded tokens' very KV: always where that costs nothing (bf16 with keys in the
    lanes, `cpu_kernels.decodes_keys_in_lanes`), else under `strata serve --deterministic`.
    """

    use_kernel: bool
    slots: Tensor | None
    mask: Tensor | None
    as_chunk: bool = False

    @staticmethod
    def build(batch: StepBatch, kv_cache: PagedKVCache, dtype: torch.dtype,
              device: torch.device) -> DecodePlan:
        if batch.num_decodes == 0:
            return DecodePlan(False, None, None)
        if cpu_kernels.supports(dtype, device):
            head_dim = kv_cache.data.shape[-1]
            as_chunk = (is_deterministic() and cpu_kernels.supports_chunk(dtype, device, head_dim)
                        or cpu_kernels.decodes_keys_in_lanes(dtype, device, head_dim))
            return DecodePlan(True, None, None, as_chunk)
        lens, bs = batch.decode_context_lens, kv_cache.block_size
        pos = torch.arange(int(lens.max()), device=lens.device)
        mask = pos[None, :] < lens[:, None]
        slots = batch.decode_block_table[:, pos // bs] * bs + pos % bs
        slots = torch.where(mask, slots, torch.full_like(slots, kv_cache.null_slot))
        return DecodePlan(False, slots, mask[:, None, None, :])


def attention(q: Tensor, k: Tensor, v: Tensor, batch: StepBatch, plan: DecodePlan,
               kv: tuple[Tensor, Tensor], groups: HeadGroups) -> Tensor:
    """Attention output (T, heads, head_dim) for every row of the step."""
    d = batch.num_decodes
    if d == q.shape[0]:  # a pure decode step: no copy into `out`
        return _decode_attention(q, batch, plan, kv, groups)
    out = q.new_empty(q.shape)
    if d:
        out[:d] = _decode_attention(q[:d], batch, plan, kv, groups)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], chunk, kv, batch.block_size,
                                       groups)
    return out


def _decode_attention(q: Tensor, batch: StepBatch, plan: DecodePlan,
                      kv: tuple[Tensor, Tensor], groups: HeadGroups) -> Tensor:
    if plan.use_kernel:
        return cpu_kernels.decode_attention(q, kv[0], kv[1], batch.decode_block_table,
                                            batch.decode_context_lens, batch.block_size,
                                            groups.start, as_chunk=plan.as_chunk)
    assert plan.slots is not None and plan.mask is not None
    keys = groups.expand(kv[0][plan.slots], 2).transpose(1, 2)  # (D, kv_heads, L, head_dim)
    values = groups.expand(kv[1][plan.slots], 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=plan.mask, enable_gqa=True
    )
    return out[:, :, 0, :]


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, chunk: PrefillChunk,
                       kv: tuple[Tensor, Tensor], block_size: int, groups: HeadGroups) -> Tensor:
    if chunk.block_row is not None:
        return cpu_kernels.chunk_attention(q, kv[0], kv[1], chunk.block_row, chunk.start_pos,
                                           block_size, groups.start)
    if chunk.context_slots is None:
        keys, values, mask = groups.expand(k, 1), groups.expand(v, 1), None
    else:
        keys = groups.expand(kv[0][chunk.context_slots], 1)
        values = groups.expand(kv[1][chunk.context_slots], 1)
        mask = chunk.mask
        if q.shape[0] <= _MATMUL_ATTENTION_MAX_ROWS:
            return _matmul_attention(q, keys, values, chunk.mask)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _matmul_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Masked GQA attention as two batched matmuls, softmax in float32 (as HF's eager path).

    q (n, heads, hd); keys, values (L, kv_heads, hd); mask (n, L) true = attend. On CPU this is
    about 1.5x faster than the masked SDPA kernel for short chunks over a long context.
    """
    n, heads, hd = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    qh = q.reshape(n, kv_heads, group, hd).permute(1, 2, 0, 3).reshape(kv_heads, group * n, hd)
    scores = torch.bmm(qh, keys.permute(1, 2, 0)).float().view(kv_heads, group, n, -1)
    scores = scores * hd ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype).view(kv_heads, group * n, -1)
    out = torch.bmm(probs, values.transpose(0, 1))  # (kv_heads, group * n, hd)
    return out.view(kv_heads, group, n, hd).permute(2, 0, 1, 3).reshape(n, heads, hd)
