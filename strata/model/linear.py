"""The linear layers' matmul: a weight packed once at load, run on every step.

`pack_linear_weight` turns a weight (out, in) into what `linear` runs fastest here: GGUF
quantized weights into the C kernels' tile layout, bf16 on CPU into oneDNN's blocked layout
(else oneDNN reorders it on every call) plus the C kernels' copy on an AVX512-BF16 CPU; anything
else stays as it is. The model's layers and the LoRA adapters' stacked products
(strata.model.lora) both run through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from strata.model import gemm
from strata.model.determinism import is_deterministic
from strata.model.gemm import PackedWeight
from strata.model.quant import QuantWeight

Linear = Tensor | PackedWeight  # what `linear` takes
_PACK_BATCH_HINT = 32  # oneDNN's packing hint; measured the same speed for 1 .. 512 rows


def pack_linear_weight(weight: Tensor | QuantWeight) -> Linear:
    """A weight (out, in) packed once for the matmuls that run it; use it with `linear` only.
    Quantized: the C kernels' tile layout. bf16 on CPU: oneDNN's blocked layout (else reordered
    on every call), plus the C kernels' on an AVX512-BF16 CPU (faster up to
    `gemm.BF16_MAX_ROWS` rows: bench/gemm_shapes.py). Anything else stays as it is."""
    if isinstance(weight, QuantWeight):
        return gemm.pack(weight)
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not _can_pack():
        return weight
    dense = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    if weight.shape[1] % 32 or not gemm.supports_bf16():
        return dense
    return gemm.pack(weight, dense)


def linear(x: Tensor, weight: Linear, bias: Tensor | None = None) -> Tensor:
    """`F.linear` for plain or `pack_linear_weight`-packed weights."""
    if isinstance(weight, PackedWeight):
        if weight.dense is None or x.shape[0] <= gemm.BF16_MAX_ROWS or is_deterministic():
            return gemm.matmul(x, weight, bias)
        weight = weight.dense
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _can_pack() -> bool:
    return (torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


__all__ = ["Linear", "linear", "pack_linear_weight"]
