"""Llama-family forward pass (Llama, Qwen2, Qwen3, Mistral, Phi-3) over a paged KV cache.

One `LlamaModel.forward` runs one engine step: the linear layers see every new token of every
sequence concatenated (bf16 weights prepacked for oneDNN and for the small-M C kernel, GGUF
quantized weights kept quantized: strata.model.gemm); attention (strata.model.attention)
runs once for all decode rows and once per prefill chunk. Everything that depends on the batch's
shape lives in a `StepBatch`, built once per step, never per layer.

Tensor and pipeline parallel use the same code: a rank's model is the slices its `RankShard`
names (column-parallel q/k/v and gate/up, row-parallel o and down, a vocab-parallel embedding
and LM head, its stage's layers) plus the `ShardComm` hooks that sum the row-parallel outputs,
gather the logits and pass hidden states between stages. The whole model is the full shard
with hooks that do nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from strata.errors import ModelLoadError
from strata.model import cpu_kernels, gemm, lora_batch
from strata.model.attention import DecodePlan, HeadGroups, PagedKVCache, StepBatch, attention
from strata.model.config import ModelConfig, RopeScaling
from strata.model.gemm import PackedWeight
from strata.model.linear import Linear, linear, pack_linear_weight
from strata.model.quant import QuantWeight, stack_rows
from strata.model.shard import LocalComm, RankShard, ShardComm

Weights = Mapping[str, Tensor | QuantWeight]


@dataclass(slots=True)
class _Layer:
    input_norm: Tensor
    qkv: Linear  # q, k and v projections stacked on the output dimension
    qkv_bias: Tensor | None
    qk_norm: Tensor | None  # (q heads + kv heads, head_dim): q_norm's rows, then k_norm's
    o: Linear
    post_norm: Tensor
    gate_up: Linear  # gate and up projections stacked on the output dimension
    down: Linear


class _WeightReader:
    """Takes tensors by HF name, checking shape; errors name the tensor and both shapes."""

    def __init__(self, weights: Weights, dtype: torch.dtype, device: str) -> None:
        self.weights = weights
        self.dtype = dtype
        self.device = device

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        tensor = self._get(name, shape)
        if isinstance(tensor, QuantWeight):
            raise ModelLoadError(f"weight {name!r} is quantized ({tensor.kind}); only linear "
                                 "weights and the embedding can be")
        return self._dense(tensor)

    def take_linear(self, name: str, shape: tuple[int, ...]) -> Tensor | QuantWeight:
        """A weight that may stay quantized (a linear weight or the embedding)."""
        tensor = self._get(name, shape)
        return tensor if isinstance(tensor, QuantWeight) else self._dense(tensor)

    def _get(self, name: str, shape: tuple[int, ...]) -> Tensor | QuantWeight:
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
        return tensor

    def _dense(self, tensor: Tensor) -> Tensor:
        out = tensor.to(device=self.device, dtype=self.dtype)
        # An owned copy: a loader's tensors may all be views of one mmap of the weights file, and
        # one kept view (the embedding, a norm) would keep every page of it resident.
        return out.clone() if out.data_ptr() == tensor.data_ptr() else out


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (head_dim / 2,), float32, with Llama-3 scaling when configured: from
    an HF config's parameters, or as a GGUF file's per-frequency divisors (llama.cpp's form)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
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


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Computed in float32 and cast back before the weight, as HF does, for bf16 parity.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    """Weights of a Llama-family model (or of one rank's shard) and its forward pass."""

    def __init__(self, config: ModelConfig, weights: Weights, *,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 shard: RankShard | None = None, comm: ShardComm | None = None) -> None:
        """`weights` hold the shard's slices under HF names (all of them for the whole model)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.shard = shard = shard or RankShard.full(config)
        self.comm: ShardComm = comm or LocalComm()
        self.is_vocab_split = len(shard.vocab) < config.vocab_size
        reader = _WeightReader(weights, dtype, device)
        hidden, vocab = config.hidden_size, len(shard.vocab)
        embed = (reader.take_linear("model.embed_tokens.weight", (vocab, hidden))
                 if shard.is_first_stage else None)
        # A quantized embedding is read from the packed bytes of the (tied) LM head.
        self.embed: Linear | None = (pack_linear_weight(embed) if isinstance(embed, QuantWeight)
                                     else embed)
        self.layers = [self._load_layer(reader, i) for i in shard.layers]
        self.norm: Tensor | None = None
        self.lm_head: Linear | None = None
        if shard.is_last_stage:
            self.norm = reader.take("model.norm.weight", (hidden,))
            tied = config.tie_word_embeddings
            if tied and isinstance(self.embed, PackedWeight):
                self.lm_head = self.embed
            else:
                lm_head = (self.embed if tied and isinstance(self.embed, Tensor) else
                           reader.take_linear("model.embed_tokens.weight" if tied
                                              else "lm_head.weight", (vocab, hidden)))
                self.lm_head = pack_linear_weight(lm_head)
        self.inv_freq = rope_inv_freq(config).to(device)
        self.heads = HeadGroups.of(shard.head_start, device)
        self.fused = cpu_kernels.supports(dtype, device)  # the fused C add + RMSNorm

    def _load_layer(self, reader: _WeightReader, i: int) -> _Layer:
        c, s = self.config, self.shard
        p = f"model.layers.{i}."
        q_dim, kv_dim = len(s.q_heads) * c.head_dim, len(s.kv_heads) * c.head_dim
        shapes = {"q": q_dim, "k": kv_dim, "v": kv_dim}
        qkv = [reader.take_linear(f"{p}self_attn.{n}_proj.weight", (d, c.hidden_size))
               for n, d in shapes.items()]
        bias = ([reader.take(f"{p}self_attn.{n}_proj.bias", (d,)) for n, d in shapes.items()]
                if c.attention_bias else None)
        qk_norm = None
        if c.qk_norm:
            norms = [reader.take(f"{p}self_attn.{n}_norm.weight", (c.head_dim,))
                     for n in ("q", "k")]
            qk_norm = torch.cat([norms[0].expand(len(s.q_heads), -1),
                                 norms[1].expand(len(s.kv_heads), -1)])
        rows = len(s.intermediate)
        mlp = [reader.take_linear(f"{p}mlp.{n}_proj.weight", (rows, c.hidden_size))
               for n in ("gate", "up")]
        return _Layer(
            input_norm=reader.take(f"{p}input_layernorm.weight", (c.hidden_size,)),
            qkv=pack_linear_weight(stack_rows(qkv)),
            qkv_bias=torch.cat(bias) if bias is not None else None,
            qk_norm=qk_norm,
            o=pack_linear_weight(
                reader.take_linear(f"{p}self_attn.o_proj.weight", (c.hidden_size, q_dim))),
            post_norm=reader.take(f"{p}post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=pack_linear_weight(stack_rows(mlp)),
            down=pack_linear_weight(
                reader.take_linear(f"{p}mlp.down_proj.weight", (c.hidden_size, rows))),
        )

    def forward(self, batch: StepBatch, kv_cache: PagedKVCache,
                loras: lora_batch.StepLoras | None = None) -> Tensor | None:
        """Run one step; returns float32 logits (S, vocab) for `batch.sample_rows` on the
        sampling rank, None on the others (the whole model always returns them). `loras`: the
        step's LoRA adapters and their rows (strata.model.lora_batch); other rows run the base."""
        x = self._embed(batch.input_ids) if self.embed is not None else self.comm.recv_hidden(
            torch.empty((batch.input_ids.shape[0], self.config.hidden_size), dtype=self.dtype,
                        device=self.device))
        cos, sin = self._rope_tables(batch.positions)
        plan = DecodePlan.build(batch, kv_cache, x.dtype, x.device)
        delta: Tensor | None = None  # the last MLP's output, added to x by the next norm
        for i, layer in enumerate(self.layers):
            delta = self._layer_forward(layer, x, delta, cos, sin, batch, plan, kv_cache.layer(i),
                                        loras, self.shard.layers[i])
        if delta is not None:
            x.add_(delta)
        if self.norm is None or self.lm_head is None:  # not the last stage: hand x on
            self.comm.send_hidden(x)
            return None
        last = _rms_norm(x[batch.sample_rows], self.norm, self.config.rms_norm_eps)
        logits = self.comm.gather_vocab(linear(last, self.lm_head))
        return logits.float() if logits is not None else None

    def _embed(self, input_ids: Tensor) -> Tensor:
        """Embedding rows; with the vocabulary split, each rank looks up its own rows (zeros
        elsewhere) and the sum over the group assembles them exactly."""
        assert self.embed is not None
        if not self.is_vocab_split:
            return gemm.embedding(input_ids, self.embed)
        local = input_ids - self.shard.vocab.start
        outside = (local < 0) | (local >= len(self.shard.vocab))
        x = gemm.embedding(local.masked_fill(outside, 0), self.embed)
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))

    def _rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin (T, 1, head_dim): rope(x) = x * cos + roll(x, half) * sin."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        cos2 = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin2 = torch.cat((-sin, sin), dim=-1)[:, None, :]  # folds rotate_half's negation
        return cos2.to(self.dtype), sin2.to(self.dtype)

    def _layer_forward(self, layer: _Layer, x: Tensor, delta: Tensor | None, cos: Tensor,
                       sin: Tensor, batch: StepBatch, plan: DecodePlan,
                       kv: tuple[Tensor, Tensor], loras: lora_batch.StepLoras | None,
                       index: int) -> Tensor:
        """Adds `delta` into the residual stream `x` in place; returns this layer's MLP output."""
        h = self._add_norm(x, delta, layer.input_norm)
        qkv = lora_batch.apply(linear(h, layer.qkv, layer.qkv_bias), h, loras, index, "qkv")
        heads, kv_heads = len(self.shard.q_heads), len(self.shard.kv_heads)
        hd = self.config.head_dim
        q_dim, kv_dim = heads * hd, kv_heads * hd
        # q and k rotate together: one rope over (T, heads + kv_heads, head_dim).
        qk = qkv[:, : q_dim + kv_dim].view(-1, heads + kv_heads, hd)
        if layer.qk_norm is not None:
            qk = _rms_norm(qk, layer.qk_norm, self.config.rms_norm_eps)
        qk = torch.addcmul(qk * cos, qk.roll(hd // 2, dims=-1), sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, q_dim + kv_dim :].view(-1, kv_heads, hd)
        kv[0].index_copy_(0, batch.slot_mapping, k)
        kv[1].index_copy_(0, batch.slot_mapping, v)
        attn = attention(q, k, v, batch, plan, kv, self.heads)
        flat = attn.view(x.shape[0], q_dim)
        adapt = lora_batch.apply
        out = self.comm.all_reduce(adapt(linear(flat, layer.o), flat, loras, index, "o"))
        h = self._add_norm(x, out, layer.post_norm)
        act = self._silu_mul(adapt(linear(h, layer.gate_up), h, loras, index, "gate_up"))
        return self.comm.all_reduce(adapt(linear(act, layer.down), act, loras, index, "down"))

    def _add_norm(self, x: Tensor, delta: Tensor | None, weight: Tensor) -> Tensor:
        """`x += delta` in place, then RMSNorm(x) * weight (one fused C call on CPU)."""
        if self.fused:
            return cpu_kernels.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            x.add_(delta)
        return _rms_norm(x, weight, self.config.rms_norm_eps)

    @staticmethod
    def _silu_mul(gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
