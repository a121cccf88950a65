"""Llama-family forward pass (Llama, Qwen2, Mistral) over a paged KV cache.

One `LlamaModel.forward` runs one engine step: the linear layers see every new token of every
sequence concatenated; attention runs once for all decode rows (one new token each, padded K/V
gather) and once per prefill chunk (several new tokens, causal with an offset). Everything that
depends on the batch's shape lives in a `StepBatch`, built once per step, never per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from strata.engine.config import ModelConfig, RopeScaling
from strata.errors import ModelLoadError

Weights = dict[str, Tensor]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Rows `start:end` of the step are consecutive new tokens of one sequence.

    When the chunk starts at position 0 it attends only to itself (`context_slots` is None);
    otherwise `context_slots` holds the slots of positions 0 .. start_pos + n and `mask[i, j]` is
    true when key j is at or before query i's position.
    """

    start: int
    end: int
    context_slots: Tensor | None
    mask: Tensor | None


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Per-step indices for one forward. Rows 0 .. num_decodes are decode rows."""

    input_ids: Tensor  # (T,)
    positions: Tensor  # (T,)
    slot_mapping: Tensor  # (T,) where each new token's K/V is written
    num_decodes: int
    decode_slots: Tensor  # (D, L) padded with the cache's null slot
    decode_mask: Tensor  # (D, 1, 1, L) true = attend
    prefills: list[PrefillChunk]
    sample_rows: Tensor  # (S,) rows whose logits are returned


class PagedKVCache:
    """K and V of every layer, addressed by slot = block_id * block_size + offset.

    Invariant: slot `null_slot` (one past the last block) stays all zeros; padded gathers point at
    it, so a masked position never reads garbage (NaN times a zero weight is still NaN).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_slot = num_blocks * block_size
        shape = (config.num_hidden_layers, 2, self.null_slot + 1,
                 config.num_key_value_heads, config.head_dim)
        self.data = torch.empty(shape, dtype=dtype, device=device)
        self.data[:, :, self.null_slot].zero_()

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """The (K, V) tensors of one layer, each (num_slots + 1, kv_heads, head_dim)."""
        return self.data[index, 0], self.data[index, 1]


@dataclass(slots=True)
class _Layer:
    input_norm: Tensor
    qkv: Tensor  # q, k and v projections stacked on the output dimension
    qkv_bias: Tensor | None
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor  # gate and up projections stacked on the output dimension
    down: Tensor


class _WeightReader:
    """Takes tensors by HF name, checking shape; errors name the tensor and both shapes."""

    def __init__(self, weights: Weights, dtype: torch.dtype, device: str) -> None:
        self.weights = weights
        self.dtype = dtype
        self.device = device

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        tensor = self.weights.get(name)
        if tensor is None:
            raise ModelLoadError(
                f"weight {name!r} is missing (expected shape {list(shape)}); the checkpoint does "
                "not match its config"
            )
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"weight {name!r} has shape {list(tensor.shape)}, expected {list(shape)} from the "
                "model config"
            )
        return tensor.to(device=self.device, dtype=self.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (head_dim / 2,), float32, with Llama-3 scaling when configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: Tensor, rs: RopeScaling) -> Tensor:
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Computed in float32 and cast back before the weight, as HF does, for bf16 parity.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    """Weights of a Llama-family model and its forward pass over a `StepBatch`."""

    def __init__(self, config: ModelConfig, weights: Weights, *,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        reader = _WeightReader(weights, dtype, device)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed = reader.take("model.embed_tokens.weight", (vocab, hidden))
        self.layers = [self._load_layer(reader, i) for i in range(config.num_hidden_layers)]
        self.norm = reader.take("model.norm.weight", (hidden,))
        self.lm_head = (self.embed if config.tie_word_embeddings
                        else reader.take("lm_head.weight", (vocab, hidden)))
        self.inv_freq = rope_inv_freq(config).to(device)

    def _load_layer(self, reader: _WeightReader, i: int) -> _Layer:
        c = self.config
        p = f"model.layers.{i}."
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes = {"q": q_dim, "k": kv_dim, "v": kv_dim}
        qkv = [reader.take(f"{p}self_attn.{n}_proj.weight", (d, c.hidden_size))
               for n, d in shapes.items()]
        bias = ([reader.take(f"{p}self_attn.{n}_proj.bias", (d,)) for n, d in shapes.items()]
                if c.attention_bias else None)
        mlp = [reader.take(f"{p}mlp.{n}_proj.weight", (c.intermediate_size, c.hidden_size))
               for n in ("gate", "up")]
        return _Layer(
            input_norm=reader.take(f"{p}input_layernorm.weight", (c.hidden_size,)),
            qkv=torch.cat(qkv),
            qkv_bias=torch.cat(bias) if bias is not None else None,
            o=reader.take(f"{p}self_attn.o_proj.weight", (c.hidden_size, q_dim)),
            post_norm=reader.take(f"{p}post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=torch.cat(mlp),
            down=reader.take(f"{p}mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
        )

    def forward(self, batch: StepBatch, kv_cache: PagedKVCache) -> Tensor:
        """Run one step; returns float32 logits (S, vocab) for `batch.sample_rows`."""
        x = F.embedding(batch.input_ids, self.embed)
        cos, sin = self._rope_tables(batch.positions)
        for i, layer in enumerate(self.layers):
            x = self._layer_forward(layer, x, cos, sin, batch, kv_cache.layer(i))
        last = _rms_norm(x[batch.sample_rows], self.norm, self.config.rms_norm_eps)
        return F.linear(last, self.lm_head).float()

    def _rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, head_dim)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _layer_forward(self, layer: _Layer, x: Tensor, cos: Tensor, sin: Tensor,
                       batch: StepBatch, kv: tuple[Tensor, Tensor]) -> Tensor:
        c = self.config
        h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        q, k, v = qkv.split((q_dim, kv_dim, kv_dim), dim=-1)
        q = q.view(-1, c.num_attention_heads, c.head_dim)
        k = k.view(-1, c.num_key_value_heads, c.head_dim)
        v = v.view(-1, c.num_key_value_heads, c.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kv[0].index_copy_(0, batch.slot_mapping, k)
        kv[1].index_copy_(0, batch.slot_mapping, v)
        attn = _attention(q, k, v, batch, kv)
        x = x + F.linear(attn.reshape(x.shape[0], q_dim), layer.o)
        h = _rms_norm(x, layer.post_norm, c.rms_norm_eps)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)


def _attention(q: Tensor, k: Tensor, v: Tensor, batch: StepBatch,
               kv: tuple[Tensor, Tensor]) -> Tensor:
    """Attention output (T, heads, head_dim) for every row of the step."""
    out = torch.empty_like(q)
    d = batch.num_decodes
    if d:
        out[:d] = _decode_attention(q[:d], batch, kv)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], chunk, kv)
    return out


def _decode_attention(q: Tensor, batch: StepBatch, kv: tuple[Tensor, Tensor]) -> Tensor:
    keys = kv[0][batch.decode_slots].transpose(1, 2)  # (D, kv_heads, L, head_dim)
    values = kv[1][batch.decode_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=batch.decode_mask, enable_gqa=True
    )
    return out[:, :, 0, :]


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, chunk: PrefillChunk,
                       kv: tuple[Tensor, Tensor]) -> Tensor:
    if chunk.context_slots is None:
        keys, values, mask = k, v, None
    else:
        keys, values = kv[0][chunk.context_slots], kv[1][chunk.context_slots]
        mask = chunk.mask
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
