"""`--weights-dtype`: which weights a model keeps quantized, and reading them from a GGUF file.

    auto   a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors stay as they are in the file (every other
           tensor is dequantized to --dtype); an HF directory's weights stay dense
    bf16   every weight dense in --dtype (GGUF tensors dequantized: the behaviour before)
    q8_0   every linear weight and the embedding in Q8_0 (quantized at load where they are not)
    q4     linear weights in Q4 (a GGUF's Q4_0 / Q4_1 kept, others quantized to Q4_1); the
           embedding / LM head stays as the file has it when quantized, else Q8_0

Quantized weights run on CPU with --dtype bfloat16 and the C kernels (strata.model.gemm): the
explicit modes refuse anything else, `auto` falls back to dense weights and says why. Norms and
biases are always dense.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from strata.errors import ConfigError
from strata.model.gguf_loader import SKIPPED, GGUFHeader, dense_tensor, hf_name, unpermute
from strata.model.quant import BLOCK, QUANT_KINDS, QuantWeight, quantize

WEIGHTS_DTYPES = ("auto", "bf16", "q8_0", "q4")
Weight = Tensor | QuantWeight
log = logging.getLogger("strata.model")


def keeps_quantized(mode: str, dtype: str, device: str) -> bool:
    """Whether `mode` serves quantized weights here; ConfigError for an explicit mode that
    cannot (auto just answers False)."""
    if mode not in WEIGHTS_DTYPES:
        raise ConfigError(f"--weights-dtype must be one of {', '.join(WEIGHTS_DTYPES)}, "
                          f"got {mode!r}")
    if mode == "bf16":
        return False
    from strata.model.gemm import supports_quantized

    reason = ("quantized weights run on the CPU" if not device.startswith("cpu")
              else "quantized weights run with --dtype bfloat16" if dtype != "bfloat16"
              else "the C kernels could not be built" if not supports_quantized() else "")
    if reason and mode != "auto":
        raise ConfigError(f"--weights-dtype {mode}: {reason}; use --weights-dtype bf16")
    if reason:
        log.info("weights dequantized to %s: %s", dtype, reason)
    return not reason


def gguf_weights(header: GGUFHeader, dtype: torch.dtype) -> Iterator[tuple[str, Weight]]:
    """(HF name, weight): the file's Q8_0 / Q4_0 / Q4_1 tensors as `QuantWeight`s (its own
    bytes, llama's q / k rows un-permuted), every other tensor dequantized to `dtype`."""
    cfg = header.config
    for t in header.reader.tensors:
        if t.name in SKIPPED:
            continue
        kind = t.tensor_type.name.lower()
        if kind not in QUANT_KINDS:
            yield hf_name(t.name, header.source), dense_tensor(t, cfg, header.source).to(dtype)
            continue
        blocks = np.array(t.data, dtype=np.uint8)  # a copy: the file's map is not kept
        if cfg.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in t.name else cfg.num_key_value_heads
            blocks = np.ascontiguousarray(unpermute(blocks, heads))
        rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        yield hf_name(t.name, header.source), QuantWeight(kind, torch.from_numpy(blocks),
                                                           (rows, cols))


def is_quantizable(name: str) -> bool:
    """Linear weights and the embedding / LM head (norms and biases stay dense)."""
    return name.endswith(("_proj.weight", "embed_tokens.weight")) or name == "lm_head.weight"


def apply_weights_dtype(weights: dict[str, Weight], mode: str, dtype: torch.dtype,
                        quantized: bool) -> None:
    """Convert `weights` in place to what `mode` keeps (`quantized`: from `keeps_quantized`)."""
    for name, w in weights.items():
        if not quantized or mode == "bf16":
            if isinstance(w, QuantWeight):
                weights[name] = w.dequantize().to(dtype)
            continue
        if mode == "auto" or not is_quantizable(name) or w.shape[1] % BLOCK:
            continue
        target = _target_kind(name, w, mode)
        if isinstance(w, QuantWeight) and w.kind == target:
            continue
        dense = w.dequantize() if isinstance(w, QuantWeight) else w
        weights[name] = quantize(dense, target)


def _target_kind(name: str, w: Weight, mode: str) -> str:
    if mode == "q8_0":
        return "q8_0"
    is_embedding = not name.endswith("_proj.weight")
    if isinstance(w, QuantWeight) and (is_embedding or w.kind in ("q4_0", "q4_1")):
        return w.kind
    return "q8_0" if is_embedding else "q4_1"


def weight_bytes(weights: dict[str, Weight]) -> int:
    return sum(w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()
               for w in weights.values())
