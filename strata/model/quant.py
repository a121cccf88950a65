"""GGUF's block-quantized weight formats, kept as GGUF's own bytes: Q8_0, Q4_0 and Q4_1.

A `QuantWeight` is a 2-D weight (rows = output features, columns = input features) whose rows
are runs of 32-column blocks, exactly as a GGUF file stores them (llama.cpp's ggml layout):

    q8_0  34 bytes: f16 d, int8 q[32]            w = d * q
    q4_0  18 bytes: f16 d, u8 q[16]              w = d * (nibble - 8)
    q4_1  20 bytes: f16 d, f16 m, u8 q[16]       w = d * nibble + m

(in q4, byte j holds column j in its low nibble and column j + 16 in its high one). Rows can be
taken freely; columns only in whole blocks (a tensor-parallel rank's share of a row-parallel
weight). `quantize` makes them from a float tensor (HF weights quantized at load) with
llama.cpp's reference rounding; `dequantize` is the float32 reference the kernels are tested
against. The matmul kernels read a repacked copy (`strata.model.gemm.pack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from strata.errors import ConfigError

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
QUANT_KINDS = tuple(BLOCK_BYTES)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A quantized (rows, cols) weight: `blocks` is uint8 (rows, cols / 32 * block bytes)."""

    kind: str
    blocks: Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.kind not in BLOCK_BYTES:
            raise ConfigError(f"quantization {self.kind!r} is not one of {QUANT_KINDS}")
        if cols % BLOCK or tuple(self.blocks.shape) != (rows, cols // BLOCK * self.block_bytes):
            raise ConfigError(f"{self.kind} weight {list(self.shape)}: blocks of shape "
                              f"{list(self.blocks.shape)} do not match (32-column blocks)")

    @property
    def block_bytes(self) -> int:
        return BLOCK_BYTES[self.kind]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, part: slice) -> QuantWeight:
        blocks = self.blocks[part]
        return QuantWeight(self.kind, blocks.contiguous(), (blocks.shape[0], self.shape[1]))

    def cols(self, part: slice) -> QuantWeight:
        """Columns start .. stop, which must fall on block boundaries (else ConfigError)."""
        start, stop, _ = part.indices(self.shape[1])
        if start % BLOCK or (stop % BLOCK and stop != self.shape[1]):
            raise ConfigError(
                f"a {self.kind} weight splits only on 32-column block boundaries: columns "
                f"{start}..{stop} of {self.shape[1]} cut a block (choose a tensor-parallel size "
                "that gives every rank whole blocks, or --weights-dtype bf16)")
        b = self.block_bytes
        blocks = self.blocks[:, start // BLOCK * b: stop // BLOCK * b].contiguous()
        return QuantWeight(self.kind, blocks, (self.shape[0], stop - start))

    def dequantize(self) -> Tensor:
        """float32 (rows, cols), computed as llama.cpp's reference dequantizer does."""
        rows, cols = self.shape
        raw = self.blocks.view(rows, cols // BLOCK, self.block_bytes)
        d = _f16(raw[..., 0:2])
        if self.kind == "q8_0":
            return (d * raw[..., 2:].view(torch.int8).float()).reshape(rows, cols)
        start = 2 if self.kind == "q4_0" else 4
        codes = raw[..., start:]
        nib = torch.cat((codes & 0xF, codes >> 4), dim=-1).float()
        if self.kind == "q4_0":
            return (d * (nib - 8.0)).reshape(rows, cols)
        return (d * nib + _f16(raw[..., 2:4])).reshape(rows, cols)


def _f16(pair: Tensor) -> Tensor:
    """Two little-endian bytes per block -> their f16 value as float32, (..., 1)."""
    return pair.contiguous().view(torch.float16).float()


def stack_rows(parts: list[Tensor | QuantWeight]) -> Tensor | QuantWeight:
    """Weights stacked on the output dimension (q, k, v -> qkv): all dense or all quantized."""
    quantized = [p for p in parts if isinstance(p, QuantWeight)]
    if not quantized:
        return torch.cat([p for p in parts if isinstance(p, Tensor)])
    if len(quantized) != len(parts):
        raise ConfigError("weights stacked together (q/k/v, gate/up) must all be quantized or "
                          "all dense")
    return cat_rows(quantized)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of one kind and column count stacked on the row dimension (q, k, v -> qkv)."""
    kinds = {(p.kind, p.shape[1]) for p in parts}
    if len(kinds) != 1:
        raise ConfigError(f"cannot stack quantized weights of different kinds or widths: {kinds}")
    blocks = torch.cat([p.blocks for p in parts])
    return QuantWeight(parts[0].kind, blocks, (blocks.shape[0], parts[0].shape[1]))


def quantize(weight: Tensor, kind: str) -> QuantWeight:
    """`weight` (rows, cols), cols a multiple of 32, quantized with llama.cpp's reference
    rounding (q8_0: d = amax / 127; q4_0: d = -max / 8 of the signed extreme; q4_1: d =
    (max - min) / 15, m = min)."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ConfigError(f"cannot quantize a weight of {cols} columns to {kind}: not a "
                          "multiple of 32")
    x = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    if kind == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127.0
        q = torch.round(x * _inverse(d)).clamp(-128, 127).to(torch.int8).view(torch.uint8)
        parts = [_f16_bytes(d), q]
    elif kind == "q4_0":
        signed = x.gather(-1, x.abs().argmax(-1, keepdim=True))
        d = signed / -8.0
        q = (x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)  # truncation, as ggml
        parts = [_f16_bytes(d), _nibbles(q)]
    elif kind == "q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15.0
        q = ((x - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
        parts = [_f16_bytes(d), _f16_bytes(lo), _nibbles(q)]
    else:
        raise ConfigError(f"quantization {kind!r} is not one of {QUANT_KINDS}")
    blocks = torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()
    return QuantWeight(kind, blocks, (rows, cols))


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)


def _f16_bytes(v: Tensor) -> Tensor:
    return v.to(torch.float16).view(torch.uint8).reshape(*v.shape[:-1], 2)


def _nibbles(q: Tensor) -> Tensor:
    return q[..., :16] | (q[..., 16:] << 4)
