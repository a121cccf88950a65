"""A BERT-style sentence encoder (all-MiniLM-L6-v2 and kin) in PyTorch: config, weights, forward.

    token ids -> word + position + token-type(0) embeddings -> LayerNorm
              -> N x [self-attention (both ways, padding masked) -> add & LayerNorm
                      -> GELU MLP -> add & LayerNorm]
              -> pooling over the real tokens (mean, or the [CLS] token) -> L2 normalize

An HF directory of a `BertModel` (config.json with `model_type: bert`, model.safetensors,
tokenizer.json) loads as is; a sentence-transformers directory (modules.json, 1_Pooling/) says
its pooling and whether it normalizes. The encoder keeps no KV cache: each request's input runs
whole, in one step (the engine's pooling requests, strata/engine/request.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from strata.engine.executor import ModelInput, ModelOutput, Pooled
from strata.errors import ModelLoadError
from strata.model.loader import read_json
from strata.model.tokenizer import Tokenizer

POOLINGS = ("mean", "cls")


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """What the encoder needs from config.json and the sentence-transformers files."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-12
    pooling: str = "mean"  # one of POOLINGS
    normalize: bool = True
    # Matryoshka training (`is_matryoshka` / `matryoshka_dimensions` in config.json): a prefix
    # of the embedding, renormalized, is itself an embedding. Without it, `dimensions` is refused.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def allows_dimensions(self, dimensions: int) -> bool:
        if dimensions == self.hidden_size:
            return True
        if not self.is_matryoshka or not 1 <= dimensions < self.hidden_size:
            return False
        return not self.matryoshka_dimensions or dimensions in self.matryoshka_dimensions


def is_encoder_dir(path: Path) -> bool:
    """Whether `path` is an HF directory of a BERT encoder."""
    config = path / "config.json"
    return path.is_dir() and config.exists() and _read(config).get("model_type") == "bert"


def encoder_config(path: Path) -> EncoderConfig:
    cfg = _read(path / "config.json")
    if cfg.get("model_type") != "bert":
        raise ModelLoadError(f"{path}: not a BERT encoder (model_type {cfg.get('model_type')!r})")
    if cfg.get("position_embedding_type", "absolute") != "absolute" or \
            cfg.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"{path}: Strata's encoder needs absolute positions and GELU")
    pooling = _read(path / "1_Pooling" / "config.json") if (path / "1_Pooling").is_dir() else {}
    modules = _read_list(path / "modules.json")
    dims = cfg.get("matryoshka_dimensions") or ()
    return EncoderConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        pooling="cls" if pooling.get("pooling_mode_cls_token") else "mean",
        normalize=not modules or any(m.get("type", "").endswith("Normalize") for m in modules),
        is_matryoshka=bool(cfg.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(int(d) for d in dims),
    )


def encoder_tokenizer(path: Path) -> Tokenizer:
    """The WordPiece tokenizer of `path`, never truncating nor padding: an input too long for
    the model is refused, not cut."""
    file = path / "tokenizer.json"
    if not file.exists():
        raise ModelLoadError(f"{path}: missing tokenizer.json (Strata needs a fast tokenizer)")
    tk = HFTokenizer.from_file(str(file))
    tk.no_truncation()
    tk.no_padding()
    return Tokenizer(tk, chat_template=None, source=str(file))


def load_encoder_weights(path: Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """model.safetensors, names without a `bert.` prefix (a BertFor* checkpoint has one)."""
    file = path / "model.safetensors"
    if not file.exists():
        raise ModelLoadError(f"{file}: weight file is missing")
    raw = load_file(str(file))
    return {k.removeprefix("bert."): v.to(dtype) for k, v in raw.items()
            if not k.endswith("position_ids")}


class EncoderExecutor:
    """The `ModelExecutor` of an encoder: every sequence is a pooling request's whole input,
    run in one padded batch; each gets its `Pooled` embedding. The engine's KV blocks are
    bookkeeping only here: nothing is cached between steps."""

    def __init__(self, encoder: BertEncoder) -> None:
        self.encoder = encoder

    def kv_bytes_per_token(self) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def execute(self, model_input: ModelInput) -> ModelOutput:
        seqs = model_input.sequences
        if not all(s.is_pooling and s.start_pos == 0 and s.needs_sample for s in seqs):
            raise RuntimeError("invariant 'encoder inputs run whole': an encoder executor got "
                               "a sequence that is not a whole pooling request")
        vectors = self.encoder.embed([s.token_ids for s in seqs]) if seqs else []
        return {s.request_id: Pooled(v) for s, v in zip(seqs, vectors, strict=True)}


class BertEncoder:
    """The forward pass over a padded batch; `embed` returns one pooled vector per input."""

    def __init__(self, config: EncoderConfig, weights: dict[str, Tensor], *,
                 device: str = "cpu") -> None:
        self.config = config
        self.device = device
        try:
            self.w = {k: weights[k].to(device) for k in _expected_names(config)}
        except KeyError as e:
            raise ModelLoadError(f"the encoder's weights lack tensor {e.args[0]!r}") from None

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        lengths = torch.tensor([len(ids) for ids in batch], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=self.device)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
        is_real = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        hidden = self._forward(ids, is_real)
        return self._pool(hidden, is_real).float().tolist()

    def _forward(self, ids: Tensor, is_real: Tensor) -> Tensor:
        w, cfg = self.w, self.config
        pos = torch.arange(ids.shape[1], device=self.device)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][pos][None]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        mask = torch.zeros(is_real.shape, dtype=x.dtype, device=self.device)
        mask = mask.masked_fill(~is_real, -math.inf)[:, None, None, :]  # keys only
        for i in range(cfg.num_hidden_layers):
            p = f"encoder.layer.{i}."
            x = self._norm(x + self._attention(x, mask, p), p + "attention.output.LayerNorm")
            h = F.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._norm(x + self._linear(h, p + "output.dense"), p + "output.LayerNorm")
        return x

    def _attention(self, x: Tensor, mask: Tensor, p: str) -> Tensor:
        b, t, _ = x.shape
        heads, dim = self.config.num_attention_heads, self.config.head_dim

        def split(name: str) -> Tensor:
            return self._linear(x, p + name).view(b, t, heads, dim).transpose(1, 2)

        q, k, v = split("attention.self.query"), split("attention.self.key"), \
            split("attention.self.value")
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self._linear(out.transpose(1, 2).reshape(b, t, -1), p + "attention.output.dense")

    def _pool(self, hidden: Tensor, is_real: Tensor) -> Tensor:
        if self.config.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weight = is_real.to(hidden.dtype)[:, :, None]
            pooled = (hidden * weight).sum(1) / weight.sum(1).clamp(min=1.0)
        return F.normalize(pooled, dim=-1) if self.config.normalize else pooled

    def _linear(self, x: Tensor, name: str) -> Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"],
                            self.config.layer_norm_eps)


def _expected_names(cfg: EncoderConfig) -> list[str]:
    names = [f"embeddings.{n}.weight" for n in
             ("word_embeddings", "position_embeddings", "token_type_embeddings")]
    names += ["embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
    per_layer = ("attention.self.query", "attention.self.key", "attention.self.value",
                 "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                 "output.dense", "output.LayerNorm")
    for i in range(cfg.num_hidden_layers):
        names += [f"encoder.layer.{i}.{m}.{s}" for m in per_layer for s in ("weight", "bias")]
    return names


def _read(file: Path) -> dict[str, Any]:
    return read_json(file)


def _read_list(file: Path) -> list[dict[str, Any]]:
    if not file.exists():
        return []
    data = json.loads(file.read_text(encoding="utf-8"))
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
