"""Read a GGUF file (llama.cpp format) into HF-named float weights (the header by gguf_file.py).

Tensors are dequantized with numpy (`gguf.quants.dequantize`) and renamed to Hugging Face names;
llama's attn_q / attn_k are un-permuted back to the HF rotary layout. `open_gguf` reads only the
header (config, tokenizer, tensor list); `gguf_tensors` dequantizes one tensor at a time, so a
converter never holds more than one in float32 (gguf_cache.py writes them to the safetensors
cache as they come).

Every `{arch}.*` hyperparameter is held to what Strata computes (model_fields.py). The one tensor
that is not a weight, `rope_freqs` (Llama-3 rope scaling as per-frequency divisors, how
llama.cpp's converter stores it), goes into the config.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from tokenizers import processors

from strata.errors import ModelLoadError
from strata.model.config import ModelConfig
from strata.model.gguf_file import GGUFFile, read_gguf
from strata.model.model_fields import check_gguf_fields
from strata.model.tokenizer import Tokenizer, byte_level_bpe
from strata.progress import progress

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = "rope_freqs.weight"
SKIPPED = {_ROPE_FREQS}  # read into the config, not a weight
_BIASED = {"qwen2": ("attn_q", "attn_k", "attn_v")}  # the only biases Strata's layers have


@dataclass
class GGUFModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    source: Path


@dataclass
class GGUFHeader:
    """What a GGUF file says before its tensor data: enough to plan a conversion."""

    reader: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    source: Path

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor the model uses, in file order."""
        return {hf_name(t.name, self.source): tuple(int(d) for d in reversed(t.shape.tolist()))
                for t in self.reader.tensors if t.name not in SKIPPED}


def open_gguf(path: Path) -> GGUFHeader:
    """The header of `path` (the tensor data stays in the file, memory-mapped)."""
    try:
        reader = read_gguf(path)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {e}"
        ) from None
    meta = _Meta(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(
            f"{path}: field 'general.architecture' = {arch!r} is not supported (llama, qwen2)"
        )
    tokenizer = _tokenizer(meta)
    config = _config(meta, arch, reader, tokenizer)  # first: it names missing fields
    check_gguf_fields(meta.under(arch), arch, source=str(path))
    _check_biases([t.name for t in reader.tensors], arch, path)
    return GGUFHeader(reader, config, tokenizer, str(meta.get("general.name", path.stem)), path)


def gguf_tensors(header: GGUFHeader, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`), one at a time, in file order; shows its progress
    (strata/progress.py): the first load of a GGUF dequantizes every tensor."""
    tensors = header.reader.tensors
    with progress(len(tensors), f"dequantizing {header.source.name}", unit="tensors") as bar:
        for t in tensors:
            if t.name not in SKIPPED:
                tensor = dense_tensor(t, header.config, header.source)
                yield hf_name(t.name, header.source), tensor.to(dtype)
            bar.update(1)


class _Meta:
    """GGUF metadata fields; a missing required field names the file and the key."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self._reader, self.path = reader, path

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self._reader.fields:
            if default is ...:
                raise ModelLoadError(f"{self.path}: GGUF metadata field {key!r} is missing")
            return default
        return self._reader.fields[key]

    def under(self, prefix: str) -> dict[str, Any]:
        """Every field named `prefix.*`, by the rest of its name."""
        return {name[len(prefix) + 1:]: self.get(name) for name in self._reader.fields
                if name.startswith(prefix + ".")}


def _config(meta: _Meta, arch: str, reader: GGUFFile, tok: Tokenizer) -> ModelConfig:
    hidden = int(meta.get(f"{arch}.embedding_length"))
    heads = int(meta.get(f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", tok.vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.get(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length")),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_freq_factors(reader, head_dim, meta.path),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
    )


def _check_biases(names: list[str], arch: str, path: Path) -> None:
    biased = _BIASED.get(arch, ())
    for name in names:
        m = _LAYER.fullmatch(name)
        if m is not None and m.group(3) == "bias" and m.group(2) not in biased:
            has = f"biases only on {', '.join(biased)}" if biased else "no biases"
            raise ModelLoadError(
                f"{path}: tensor {name!r} is not implemented by Strata ({arch} layers have {has})"
            )


def _rope_freq_factors(reader: GGUFFile, head_dim: int, path: Path) -> tuple[float, ...] | None:
    tensor = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    if factors.shape != (head_dim // 2,) or not np.all(factors > 0):
        raise ModelLoadError(f"{path}: tensor {_ROPE_FREQS!r} must hold head_dim / 2 = "
                             f"{head_dim // 2} positive factors, got shape {list(factors.shape)}")
    return tuple(float(f) for f in factors)


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def _tokenizer(meta: _Meta) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{meta.path}: field 'tokenizer.ggml.model' = {kind!r} is not supported "
            "(Strata reads byte-level BPE tokenizers, model 'gpt2')"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = meta.get("tokenizer.ggml.merges")
    tk = byte_level_bpe(tokens, merges, types, pre=str(meta.get("tokenizer.ggml.pre", "gpt2")))
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
        tk.post_processor = processors.TemplateProcessing(  # encode(add_special_tokens=True)
            single=[tokens[int(bos)], "$A"], special_tokens=[(tokens[int(bos)], int(bos))]
        )
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos_ids = [int(i) for i in eos_ids if i is not None]
    return Tokenizer(
        tk,
        chat_template=meta.get("tokenizer.chat_template", None),
        bos_token=tokens[int(bos)] if bos is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        eos_token_ids=eos_ids,
        source=str(meta.path),
    )


def hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"{path}: unexpected tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def dense_tensor(t: Any, cfg: ModelConfig, path: Path) -> torch.Tensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        array = dequantize(t.data, t.tensor_type).reshape(shape)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized"
        ) from None
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name!r} is malformed: {e}") from None
    if cfg.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg.num_attention_heads if "attn_q" in t.name else cfg.num_key_value_heads
        array = unpermute(array, heads)
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf `permute` (rotary halves -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
