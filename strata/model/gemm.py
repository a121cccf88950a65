"""Weight-stationary matmuls in C over repacked weights (csrc/gemm.h): bf16 and GGUF-quantized.

`pack` turns a weight into a `PackedWeight` once, at load; `matmul` runs x @ W^T with it and
`rows` dequantizes rows of a quantized one (the embedding of a tied LM head, read from the same
bytes). Quantized weights stay quantized: the kernel decodes each block in registers, once for
every row of the batch. bf16 weights get this kernel only where it beats oneDNN's packed matmul
(small M, measured per shape: `bench/gemm_shapes.py`); larger M runs oneDNN on a copy it packed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from strata.model.determinism import is_deterministic
from strata.model.kernel_build import kernel_library
from strata.model.quant import QuantWeight

KINDS = {"bf16": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3}
TILE, RECORD_BYTES = 16, {"bf16": 1024, "q8_0": 544, "q4_0": 288, "q4_1": 320}
# Rows up to which bf16 weights run the C kernels instead of oneDNN's packed matmul.
BF16_MAX_ROWS = 64
# Rows from which the AMX kernel replaces the vector one, where the CPU has AMX: quantized
# weights pay a decode per call, bf16 weights do not (2 threads, SmolLM2's shapes, 2026-12-06:
# a Q4_1 layer 271 against 310 us at 3 rows, 299 against 215 at 2; docs/benchmarks.md).
AMX_MIN_ROWS = {"bf16": 2, "q8_0": 3, "q4_0": 3, "q4_1": 3}

@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A (N, K) weight in the kernel's tile layout; `dense` is oneDNN's packed copy of a bf16
    weight, for the row counts where oneDNN is faster (None for quantized weights)."""

    kind: str
    data: Tensor
    shape: tuple[int, int]
    dense: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of both layouts."""
        dense = self.dense.numel() * self.dense.element_size() if self.dense is not None else 0
        return self.data.numel() * self.data.element_size() + dense


def supports_bf16() -> bool:
    """Whether the bf16 vector kernel exists here (AVX512-BF16 at build time)."""
    lib = kernel_library()
    return lib is not None and bool(lib.gemm_has_bf16())


@functools.cache
def has_amx() -> bool:
    """Whether the AMX kernel runs here (built with AMX, and the kernel granted AMX state);
    asked once per process (`matmul` asks on every call)."""
    lib = kernel_library()
    return lib is not None and bool(lib.gemm_amx_init())


def supports_quantized() -> bool:
    """Whether quantized weights can be served (the C kernels built; any x86-64 or other CPU)."""
    return kernel_library() is not None


def pack(weight: Tensor | QuantWeight, dense: Tensor | None = None) -> PackedWeight:
    """The tile layout of a quantized weight, or of a bf16 one (K % 32 == 0) with its oneDNN
    copy `dense`. Call only where the kernels are built (and, for bf16, `supports_bf16()`)."""
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports_quantized() first"
    n, k = weight.shape
    tiles, blocks = -(-n // TILE), k // 32
    if isinstance(weight, QuantWeight):
        data = torch.empty(tiles * blocks * RECORD_BYTES[weight.kind], dtype=torch.uint8)
        lib.gemm_pack_q(KINDS[weight.kind], weight.blocks.data_ptr(), n, k, data.data_ptr())
        return PackedWeight(weight.kind, data, (n, k))
    w = weight.contiguous()
    assert w.dtype == torch.bfloat16 and k % 32 == 0, "invariant bf16_pack: bf16, K % 32 == 0"
    data = torch.empty(tiles * TILE * k, dtype=torch.bfloat16)
    lib.gemm_pack_bf16(w.data_ptr(), n, k, data.data_ptr())
    return PackedWeight("bf16", data, (n, k), dense)


def matmul(x: Tensor, weight: PackedWeight, bias: Tensor | None = None, *,
           kernel: str = "auto") -> Tensor:
    """x (M, K) bf16 @ W^T (+ bias (N,) bf16) -> (M, N) bf16. `kernel`: auto (AMX from
    `AMX_MIN_ROWS[kind]` rows where it runs, from 1 row under `is_deterministic()`, else the
    vector kernel), or "vector", "amx",
    "portable" (the quantized kernels' portable loop) for tests and benchmarks."""
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built"
    n, k = weight.shape
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16)
    if m == 0:
        return out
    b = bias.contiguous().data_ptr() if bias is not None else None
    if kernel == "auto":
        min_rows = 1 if is_deterministic() else AMX_MIN_ROWS[weight.kind]
        kernel = "amx" if m >= min_rows and has_amx() else "vector"
    args = (x.data_ptr(), m, k, weight.data.data_ptr(), n, b, out.data_ptr())
    if kernel == "amx":
        assert has_amx(), "invariant amx: check has_amx() first"
        lib.gemm_amx(KINDS[weight.kind], *args)
    elif weight.kind == "bf16":
        lib.gemm_bf16(*args)
    else:
        fn = lib.gemm_q_portable if kernel == "portable" else lib.gemm_q
        fn(KINDS[weight.kind], *args)
    return out


def rows(weight: PackedWeight, ids: Tensor) -> Tensor:
    """Rows `ids` of a packed quantized weight, dequantized to bf16 (n, K)."""
    lib = kernel_library()
    assert lib is not None and weight.kind != "bf16", "invariant quantized_rows"
    n, k = weight.shape
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), k), dtype=torch.bfloat16)
    lib.gemm_rows_q(KINDS[weight.kind], weight.data.data_ptr(), n, k, ids.data_ptr(),
                    ids.numel(), out.data_ptr())
    return out


def embedding(ids: Tensor, table: Tensor | PackedWeight) -> Tensor:
    """`F.embedding`, or the rows of a packed quantized table (a tied LM head's bytes)."""
    if isinstance(table, PackedWeight):
        return rows(table, ids)
    return torch.nn.functional.embedding(ids, table)
