"""The small-M matmul kernels (csrc/gemm.h) and GGUF's block formats (strata.model.quant).

Story: a weight of 40 output columns (two and a half tiles) and 96 input positions (three
blocks) is quantized with Strata's `quantize`, which must give the very bytes of the `gguf`
package's reference quantizer; packed into the kernel's tile layout, it multiplies batches of 1
to 37 rows (every pass width and every remainder), with and without a bias, and each result must
equal the float64 product of the dequantized weight, to bf16's rounding of the output. Each
branch of the kernel (the vector loop, the portable loop, the AMX tiles) is its own test: one the
CPU cannot run (AMX, AVX512-BF16) is reported as a skip that names it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from model.built_kernels import require_kernels
from required import require
from torch import Tensor

from strata.errors import ConfigError
from strata.model import gemm
from strata.model.determinism import is_deterministic, set_deterministic
from strata.model.quant import QUANT_KINDS, QuantWeight, cat_rows, quantize

N, K = 40, 96
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 15, 16, 17, 37]
QUANT_BRANCHES = ["vector", "portable", "amx"]  # every branch of gemm.matmul for GGUF blocks
BF16_BRANCHES = ["vector", "amx"]


def weight(n: int = N, k: int = K, seed: int = 5) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    w[3, :32] = 0.0  # an all-zero block: scale 0
    w[7, 40] = 2.5  # an outlier
    return w


def reference(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    out = x.double() @ w.double().T
    return out + bias.double() if bias is not None else out


def assert_bf16_close(got: Tensor, want: Tensor) -> None:
    """Within bf16's rounding of the output (8 mantissa bits) plus float32 accumulation."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quantize_gives_ggufs_bytes(kind: str) -> None:
    w = weight()
    ours = quantize(w, kind)
    theirs = gguf_quantize(w.numpy(), GGMLQuantizationType[kind.upper()])
    assert np.array_equal(ours.blocks.numpy(), theirs)
    assert ours.nbytes == theirs.nbytes


def require_branch(kernel: str) -> None:
    """The kernels build here; the AMX branch runs only where the CPU has AMX: elsewhere the
    skip names the branch that was not run (a failure where STRATA_REQUIRE names amx)."""
    require_kernels()
    if kernel == "amx":
        require("amx")


@pytest.mark.parametrize("kernel", QUANT_BRANCHES)
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quantized_matmul_equals_the_dequantized_product(kind: str, kernel: str) -> None:
    require_branch(kernel)
    q = quantize(weight(), kind)
    w = q.dequantize()
    if kernel == "amx":  # it rounds the dequantized weights to bf16 first
        w = w.bfloat16().float()
    packed = gemm.pack(q)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2)).bfloat16()
    for m in ROW_COUNTS:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
        for b in (None, bias):
            assert_bf16_close(gemm.matmul(x, packed, b, kernel=kernel), reference(x, w, b))


@pytest.mark.parametrize("kernel", BF16_BRANCHES)
def test_bf16_matmul_equals_the_product(kernel: str) -> None:
    require_branch(kernel)
    require("avx512_bf16")  # without it bf16 weights run oneDNN: the skip names the branch
    w = weight().bfloat16()
    packed = gemm.pack(w)
    bias = torch.randn(N).bfloat16()
    for m in [*ROW_COUNTS, 64, 70]:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
        want = reference(x, w.float(), bias)
        assert_bf16_close(gemm.matmul(x, packed, bias, kernel=kernel), want)
    assert gemm.matmul(torch.empty(0, K).bfloat16(), packed, kernel=kernel).shape == (0, N)


@pytest.mark.parametrize("kind", [*QUANT_KINDS, "bf16"])
def test_one_kernel_gives_a_row_the_same_bits_whatever_the_row_count(kind: str) -> None:
    """`set_deterministic` (`strata serve --deterministic`, issue 31): each row's result is the
    very bits it gets alone, at every row count, where by default the kernel changes with M."""
    from strata.model.linear import linear, pack_linear_weight

    require_kernels()
    w = weight(n=50, k=128)
    packed = gemm.pack(quantize(w, kind)) if kind != "bf16" else pack_linear_weight(w.bfloat16())
    x = torch.randn(80, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    set_deterministic(True)
    try:
        alone = torch.cat([linear(x[r:r + 1], packed) for r in range(80)])
        for m in [*ROW_COUNTS, 64, 65, 80]:
            assert torch.equal(linear(x[:m], packed), alone[:m]), m
    finally:
        set_deterministic(False)
    assert not is_deterministic()


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_rows_read_the_packed_bytes(kind: str) -> None:
    require_kernels()
    q = quantize(weight(), kind)
    ids = torch.tensor([0, 39, 3, 17, 16, 7])
    want = q.dequantize()[ids].bfloat16()
    assert torch.equal(gemm.rows(gemm.pack(q), ids), want)


def test_rows_columns_and_stacking_keep_the_values() -> None:
    w = weight()
    q = quantize(w, "q4_1")
    full = q.dequantize()
    assert torch.equal(q.rows(slice(8, 24)).dequantize(), full[8:24])
    assert torch.equal(q.cols(slice(32, 96)).dequantize(), full[:, 32:])
    stacked = cat_rows([q.rows(slice(0, 10)), q.rows(slice(10, 40))])
    assert torch.equal(stacked.dequantize(), full)
    with pytest.raises(ConfigError, match="block boundaries"):
        q.cols(slice(16, 96))
    with pytest.raises(ConfigError, match="different kinds"):
        cat_rows([q, quantize(w, "q8_0")])
    with pytest.raises(ConfigError, match="multiple of 32"):
        quantize(torch.zeros(4, 48), "q8_0")
    with pytest.raises(ConfigError, match="do not match"):
        QuantWeight("q8_0", torch.zeros(4, 33, dtype=torch.uint8), (4, 32))
