"""Uneven head groups (a tensor-parallel rank's: KV head 0 serves 4 query heads, KV head 1 two):
the C kernels and the torch fallback give what attention over K/V copied to one KV head per
query head gives."""

from __future__ import annotations

import pytest
import torch
from model.built_kernels import require_kernels
from model.test_cpu_kernels import BLOCK, HEAD_DIM, scattered_cache

from strata.model import cpu_kernels
from strata.model.attention import DecodePlan, HeadGroups, PagedKVCache, StepBatch, attention

HEAD_START = (0, 4, 6)
KV_OF_HEAD = [0, 0, 0, 0, 1, 1]


def per_head(kv: torch.Tensor) -> torch.Tensor:
    return kv[:, KV_OF_HEAD].contiguous()


def test_head_groups_know_when_they_are_uneven() -> None:
    assert HeadGroups.of((0, 3, 6), "cpu").kv_of_head is None
    uneven = HeadGroups.of(HEAD_START, "cpu")
    assert uneven.kv_of_head is not None and uneven.kv_of_head.tolist() == KV_OF_HEAD


def test_decode_kernel_reads_each_heads_own_kv_head() -> None:
    require_kernels()
    q, k, v, table, lens = scattered_cache(torch.float32)
    got = cpu_kernels.decode_attention(q, k, v, table, lens, BLOCK,
                                       torch.tensor(HEAD_START))
    want = cpu_kernels.decode_attention(q, per_head(k), per_head(v), table, lens, BLOCK)
    assert torch.equal(got, want)  # the G = 1 kernel is held to a float64 reference elsewhere


def test_chunk_kernel_reads_each_heads_own_kv_head() -> None:
    require_kernels()
    _, k, v, table, _ = scattered_cache(torch.float32)
    row, start, n = table[4], 20, 17  # the 37-position sequence: positions 20 .. 36 are new
    q = torch.randn(n, 6, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    got = cpu_kernels.chunk_attention(q, k, v, row, start, BLOCK, torch.tensor(HEAD_START))
    want = cpu_kernels.chunk_attention(q, per_head(k), per_head(v), row, start, BLOCK)
    assert torch.equal(got, want)


def test_the_torch_fallback_expands_kv_for_uneven_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    require_kernels()
    q, k, v, table, lens = scattered_cache(torch.float32)
    groups = HeadGroups.of(HEAD_START, "cpu")
    batch = StepBatch(input_ids=torch.zeros(5, dtype=torch.long), positions=lens - 1,
                      slot_mapping=torch.zeros(5, dtype=torch.long), num_decodes=5,
                      decode_block_table=table, decode_context_lens=lens, prefills=[],
                      sample_rows=torch.arange(5), block_size=BLOCK)
    cache = PagedKVCache.__new__(PagedKVCache)
    cache.block_size, cache.null_slot = BLOCK, k.shape[0] - 1  # a NaN slot: masked, never used
    cache.data = torch.stack([k, v])[None]  # one layer
    with_kernel = attention(q, q, q, batch, DecodePlan.build(batch, cache, q.dtype, q.device),
                            (k, v), groups)
    monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    plan = DecodePlan.build(batch, cache, q.dtype, q.device)
    assert not plan.use_kernel
    fallback = attention(q, q, q, batch, plan, (k.nan_to_num(), v.nan_to_num()), groups)
    torch.testing.assert_close(fallback, with_kernel, atol=1e-5, rtol=1e-5)
