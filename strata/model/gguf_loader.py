"""Read a GGUF file (llama.cpp format) with the `gguf` package into HF-named float weights.

Tensors are dequantized with numpy (`gguf.quants.dequantize`) and renamed to Hugging Face names;
llama's attn_q / attn_k are un-permuted back to the HF rotary layout. The result (weights in the
requested dtype, plus config and tokenizer in the header metadata) is cached as one safetensors
file keyed by the GGUF file's size, mtime and first bytes, so a second load skips dequantization.
The first load shows its progress, tensor by tensor (strata/progress.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from strata.errors import ModelLoadError
from strata.model.config import ModelConfig
from strata.model.tokenizer import Tokenizer, byte_level_bpe
from strata.progress import progress

CACHE_FORMAT = "strata-gguf-1"
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
_SKIPPED = {"rope_freqs.weight"}


@dataclass
class GGUFModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    source: Path


def load_gguf(path: Path, *, dtype: torch.dtype, cache_dir: Path | None) -> GGUFModel:
    """Load `path`, from the dequantized cache in `cache_dir` when it is there."""
    cache_file = _cache_file(path, dtype, cache_dir) if cache_dir is not None else None
    if cache_file is not None and cache_file.exists():
        cached = _read_cache(cache_file, path)
        if cached is not None:
            return cached
    model = _read_gguf(path, dtype)
    if cache_file is not None:
        _write_cache(cache_file, model)
    return model


def _read_gguf(path: Path, dtype: torch.dtype) -> GGUFModel:
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
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
    config = _config(meta, arch, reader, tokenizer)
    weights = {}
    with progress(len(reader.tensors), f"dequantizing {path.name}", unit="tensors") as bar:
        for t in reader.tensors:
            if t.name not in _SKIPPED:
                weights[_hf_name(t.name, path)] = _tensor(t, config, path).to(dtype)
            bar.update(1)
    name = str(meta.get("general.name", path.stem))
    return GGUFModel(config, weights, tokenizer, name, path)


class _Meta:
    """GGUF metadata fields; a missing required field names the file and the key."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader, self.path = reader, path

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"{self.path}: GGUF metadata field {key!r} is missing")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelLoadError(
                f"{self.path}: GGUF metadata field {key!r} is corrupt: {e}"
            ) from None


def _config(meta: _Meta, arch: str, reader: GGUFReader, tok: Tokenizer) -> ModelConfig:
    hidden = int(meta.get(f"{arch}.embedding_length"))
    heads = int(meta.get(f"{arch}.attention.head_count"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", tok.vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.get(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length")),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
    )


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


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"{path}: unexpected tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _tensor(t: Any, cfg: ModelConfig, path: Path) -> torch.Tensor:
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


def _cache_file(path: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    st = path.stat()
    digest = hashlib.sha256(f"{CACHE_FORMAT}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 16))
    return cache_dir / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}.safetensors"


def _write_cache(cache_file: Path, model: GGUFModel) -> None:
    meta = {
        "format": CACHE_FORMAT,
        "name": model.name,
        "config": {f.name: getattr(model.config, f.name) for f in dataclasses.fields(model.config)},
        "tokenizer": model.tokenizer.to_json(),
        "chat_template": model.tokenizer.chat_template,
        "bos_token": model.tokenizer.bos_token,
        "eos_token": model.tokenizer.eos_token,
        "eos_token_ids": list(model.tokenizer.eos_token_ids),
    }
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".tmp")
    os.close(fd)
    try:
        tensors = {k: v.contiguous() for k, v in model.weights.items()}
        save_file(tensors, tmp, metadata={"strata": json.dumps(meta)})
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
        os.replace(tmp, cache_file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_cache(cache_file: Path, source: Path) -> GGUFModel | None:
    """The cached model, or None when the cache file is unreadable (it is then rewritten)."""
    try:
        with safe_open(str(cache_file), "pt") as f:
            meta = json.loads(f.metadata()["strata"])
        weights = load_file(str(cache_file))
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError):
        return None
    if meta.get("format") != CACHE_FORMAT:
        return None
    cfg = dict(meta["config"], eos_token_ids=tuple(meta["config"]["eos_token_ids"]))
    tokenizer = Tokenizer(
        HFTokenizer.from_str(meta["tokenizer"]),
        chat_template=meta["chat_template"],
        bos_token=meta["bos_token"],
        eos_token=meta["eos_token"],
        eos_token_ids=meta["eos_token_ids"],
        source=str(source),
    )
    return GGUFModel(ModelConfig(**cfg), weights, tokenizer, meta["name"], source)
