"""The C kernels against plain torch references, and the model on its torch fallback paths.

Story: five sequences of 1 to 37 cached positions read a cache whose blocks are handed out in a
scattered order and whose unused slots hold NaN; the kernel's output must equal softmax attention
computed in float64 over exactly the positions each sequence owns. Then the whole model, with the
kernels and forced onto the torch fallback paths, must produce HF's greedy tokens. The fused
add + norm kernel must round where torch (and HF) round. Where a C compiler exists the kernels
must build: a failed build fails these tests (see built_kernels), it never skips them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model.built_kernels import require_kernels
from model.test_llama_parity import hf_greedy, make_executor, prompts, run_greedy, tiny_hf_model
from required import require
from torch import Tensor

from strata.model import cpu_kernels
from strata.model.kernel_build import SOURCE, compile_kernels, find_compiler

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
LENGTHS = [1, 4, 5, 17, 37]


def scattered_cache(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, K, V, block table and lengths; slots no sequence owns are NaN."""
    gen = torch.Generator().manual_seed(11)
    num_blocks = 64
    k = torch.full((num_blocks * BLOCK, KV_HEADS, HEAD_DIM), float("nan"))
    v = torch.full_like(k, float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // BLOCK) for n in LENGTHS) + 1  # one unused column of padding
    table = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        for b in range(-(-n // BLOCK)):
            table[row, b] = order.pop()
            for j in range(min(BLOCK, n - b * BLOCK)):
                slot = int(table[row, b]) * BLOCK + j
                k[slot] = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
                v[slot] = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(len(LENGTHS), HEADS, HEAD_DIM, generator=gen)
    lens = torch.tensor(LENGTHS, dtype=torch.long)
    return q.to(dtype), k.to(dtype), v.to(dtype), table, lens


def reference(q: Tensor, k: Tensor, v: Tensor, table: Tensor, lens: Tensor) -> Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for row, n in enumerate(lens.tolist()):
        slots = [int(table[row, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        keys = k[slots].double().repeat_interleave(group, dim=1)  # (n, heads, hd)
        values = v[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].double(), keys) / HEAD_DIM ** 0.5
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_reference_and_never_reads_unowned_slots(dtype: torch.dtype,
                                                               atol: float) -> None:
    require_kernels()
    q, k, v, table, lens = scattered_cache(dtype)
    out = cpu_kernels.decode_attention(q, k, v, table, lens, BLOCK)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference(q, k, v, table, lens), atol=atol, rtol=0)


def test_kernel_reads_query_rows_with_a_stride() -> None:
    require_kernels()
    q, k, v, table, lens = scattered_cache(torch.float32)
    wide = torch.cat([q, torch.zeros(len(LENGTHS), 2, HEAD_DIM)], dim=1)  # as q of a fused qk
    strided = wide[:, :HEADS]
    assert not strided.is_contiguous()
    expected = cpu_kernels.decode_attention(q, k, v, table, lens, BLOCK)
    got = cpu_kernels.decode_attention(strided, k, v, table, lens, BLOCK)
    assert torch.equal(got, expected)


def chunk_reference(q: Tensor, k: Tensor, v: Tensor, table_row: Tensor, start: int) -> Tensor:
    """Query i of the chunk attends to positions 0 .. start + i, in float64."""
    n = q.shape[0]
    lens = torch.arange(start + 1, start + n + 1)
    return reference(q, k, v, table_row.expand(n, -1), lens)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("start", "n"), [(36, 1), (32, 5), (21, 16), (0, 37), (0, 6)])
def test_chunk_kernel_equals_reference_over_a_scattered_cache(dtype: torch.dtype, atol: float,
                                                              start: int, n: int) -> None:
    """A chunk of n tokens of the 37-position sequence (n * 3 lanes: full and partial tiles)."""
    require_kernels()
    _, k, v, table, _ = scattered_cache(dtype)
    row = table[LENGTHS.index(37)]
    q = torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(n)).to(dtype)
    out = cpu_kernels.chunk_attention(q, k, v, row, start, BLOCK)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), chunk_reference(q, k, v, row, start), atol=atol,
                               rtol=0)
    strided = torch.cat([q, torch.zeros(n, 2, HEAD_DIM, dtype=dtype)], dim=1)[:, :HEADS]
    assert torch.equal(cpu_kernels.chunk_attention(strided, k, v, row, start, BLOCK), out)


def test_chunk_kernel_rows_equal_decode_kernel_rows() -> None:
    """Row i of a chunk is the decode query at position start + i: same maths, same floats."""
    require_kernels()
    _, k, v, table, _ = scattered_cache(torch.float32)
    row = table[LENGTHS.index(37)]
    q = torch.randn(9, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    chunk = cpu_kernels.chunk_attention(q, k, v, row, 28, BLOCK)
    decode = cpu_kernels.decode_attention(q, k, v, row.expand(9, -1).contiguous(),
                                          torch.arange(29, 38), BLOCK)
    torch.testing.assert_close(chunk, decode, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_as_chunk_gives_each_row_the_chunk_kernels_very_bits(dtype: torch.dtype) -> None:
    """`as_chunk` (--deterministic): a decoded position's attention is bit for bit what a
    prefill chunk computes there, whatever the chunk, so a resumed stream recomputes the same KV;
    the plain decode kernel sums in another order and differs in the last bits."""
    require_kernels()
    q, k, v, table, lens = scattered_cache(dtype)
    decoded = cpu_kernels.decode_attention(q, k, v, table, lens, BLOCK, as_chunk=True)
    assert not decoded.isnan().any()
    plain = cpu_kernels.decode_attention(q, k, v, table, lens, BLOCK)
    assert not torch.equal(decoded, plain)
    for i, n in enumerate(LENGTHS):
        for size in {1, min(n, 5), n}:  # the decoded row as the last of a chunk of each size
            chunk = torch.randn(size, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(
                size)).to(dtype)
            chunk[-1] = q[i]
            got = cpu_kernels.chunk_attention(chunk, k, v, table[i], n - size, BLOCK)
            assert torch.equal(got[-1], decoded[i]), (n, size)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(10, 2, 96), (17, 1, 64), (4, 4, 32), (6, 2, 48)])
def test_decoded_rows_equal_their_prefill_for_other_groups_and_head_dims(
        heads: int, kv_heads: int, head_dim: int) -> None:
    """bf16 decode rows take the keys-in-lanes path by default (groups of up to 16 heads, head
    dims a multiple of 32: a group of 5 spans two passes of the V sums, 96 dims two of their
    blocks); a group of 17 or 48 dims falls back to the chunk task. Every row, at lengths
    across 16-key tiles, is its prefill's to the bit."""
    require_kernels()
    gen = torch.Generator().manual_seed(heads * head_dim)
    lens = [1, 2, 15, 16, 17, 33, 70]
    width = max(lens) // BLOCK + 1
    slots = len(lens) * width * BLOCK
    k = torch.randn(slots, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(slots, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).bfloat16()
    assert cpu_kernels.decodes_keys_in_lanes(torch.bfloat16, "cpu", head_dim) == (
        head_dim % 32 == 0 and cpu_kernels.decodes_keys_in_lanes(torch.bfloat16, "cpu", 64))
    decoded = cpu_kernels.decode_attention(q, k, v, table, torch.tensor(lens), BLOCK,
                                           as_chunk=True)
    for i, n in enumerate(lens):
        chunk = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
        chunk[-1] = q[i]
        got = cpu_kernels.chunk_attention(chunk, k, v, table[i], 0, BLOCK)
        assert torch.equal(got[-1], decoded[i]), n


def test_torch_fallback_path_keeps_hf_parity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the kernel (no compiler, fp16, GPU), decode rows use the padded gather + SDPA.

    Both paths are held to HF's greedy tokens, so the fallback is never compared with itself
    (as it would be, were the kernels not built)."""
    hf = tiny_hf_model("llama")
    token_lists = prompts()
    expected = [hf_greedy(hf, p, 8) for p in token_lists]
    with_kernel = run_greedy(make_executor(hf), token_lists, num_new=8)
    assert with_kernel == expected
    monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    executor = make_executor(hf)
    assert executor.kv_cache is not None and not executor.chunk_kernel
    executor.kv_cache.data[:, :, : executor.kv_cache.null_slot] = float("nan")
    fallback = run_greedy(executor, token_lists, num_new=8)
    assert fallback == expected
    assert fallback == with_kernel


def test_the_kernels_build_wherever_a_compiler_exists() -> None:
    require_kernels()
    assert cpu_kernels.supports(torch.float32, "cpu")
    assert cpu_kernels.supports(torch.bfloat16, "cpu")
    assert cpu_kernels.supports_chunk(torch.float32, "cpu", HEAD_DIM)


def test_a_kernel_that_does_not_compile_fails_with_the_compilers_message(tmp_path: Path) -> None:
    """A scratch copy of the sources with one line broken: the build keeps the compiler's
    error, and the tests' gate turns it into a failure, never a skip."""
    if find_compiler() is None:
        require("cc")
    for path in SOURCE.parent.iterdir():
        (tmp_path / path.name).write_text(path.read_text())
    broken = tmp_path / SOURCE.name
    broken.write_text(broken.read_text() + "\nint broken_on_purpose = ;\n")
    build = compile_kernels(broken)
    assert not build.is_built and build.compiler is not None
    assert "broken_on_purpose" in build.error
    with pytest.raises(pytest.fail.Exception, match="broken_on_purpose"):
        require_kernels(build)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_updates_the_residual_and_rounds_like_torch(dtype: torch.dtype) -> None:
    require_kernels()
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    delta = torch.randn(7, 96, generator=gen).to(dtype)
    weight = (torch.randn(96, generator=gen) * 0.2 + 1).to(dtype)
    expected_x = x + delta  # torch rounds the sum to `dtype`, as the kernel must
    x32 = expected_x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = cpu_kernels.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_x)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: at most one rounding step apart
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    again = cpu_kernels.add_rms_norm(x, None, weight, 1e-5)  # no delta: x stays as it is
    assert torch.equal(x, expected_x) and torch.equal(again, out)

