"""Each rank reads only its slices of the weights; no process ever holds the whole model.

`prepare_model` runs once, in the serving process, before any rank starts: it reads an HF
directory's config and tokenizer, or converts a GGUF file into the safetensors cache tensor by
tensor (gguf_cache.convert_gguf) and reads them from its metadata; it checks every tensor's shape
in the file headers. Its `WeightFiles` (tensor name -> safetensors file) serve the ranks on its
node; ranks on other nodes get theirs through the model store (weight_source.py). `load_shard`
reads a rank's slices through `safe_open(...).get_slice`: rows of q/k/v,
gate/up, the embedding and the LM head; columns of o and down; only the rank's stage's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import Tensor

from strata.errors import ConfigError, ModelLoadError
from strata.model.config import ModelConfig
from strata.model.gguf_cache import cached_header, convert_gguf
from strata.model.loader import (
    expected_shapes,
    hf_config_and_tokenizer,
    safetensors_files,
    torch_dtype_of,
)
from strata.model.shard import RankShard
from strata.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class WeightFiles:
    """Which safetensors file holds each tensor (`files["*"]`: one file holds them all)."""

    files: dict[str, str]

    def file_of(self, name: str) -> str:
        return self.files.get(name) or self.files["*"]


@dataclass(slots=True)
class PreparedModel:
    """A model ready for ranks to load their shards: everything but the weights."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    source: Path
    weights: WeightFiles
    uri: str = ""  # the model as the store names it (ranks on other nodes resolve it)
    cache_dir: Path | None = None
    s3_endpoint_url: str | None = None


def prepare_model(path: str | Path, *, dtype: str, cache_dir: Path | None, uri: str = "",
                  s3_endpoint_url: str | None = None) -> PreparedModel:
    """Config, tokenizer and weight files of an HF directory or a `.gguf` file (converted into
    `cache_dir` first); raises ModelLoadError naming a missing or misshapen tensor. `uri`
    (default: `path` itself) is what ranks on other nodes resolve through the model store."""
    torch_dtype = torch_dtype_of(dtype)
    src = Path(path)
    if src.is_dir():
        config, tokenizer = hf_config_and_tokenizer(src)
        files = {name: str(file) for name, file in safetensors_files(src).items()}
        prepared = PreparedModel(config, tokenizer, src.resolve().name, src, WeightFiles(files))
    elif src.is_file():
        if cache_dir is None:
            raise ConfigError("a parallel instance reads a GGUF model through the safetensors "
                              "cache: give it a cache directory")
        cache_file = convert_gguf(src, dtype=torch_dtype, cache_dir=cache_dir)
        header = cached_header(cache_file, src)
        if header is None:
            raise ModelLoadError(f"{cache_file}: the converted cache cannot be read")
        config, tokenizer, name = header
        prepared = PreparedModel(config, tokenizer, name, src,
                                 WeightFiles({"*": str(cache_file)}))
    else:
        raise ModelLoadError(f"{src}: no such model directory or .gguf file")
    if prepared.config.architecture == "phi3":
        raise ConfigError(f"{src}: Phi-3 checkpoints keep q/k/v and gate/up fused; serve them "
                          "in one process (without tensor or pipeline parallel)")
    _check_shapes(prepared.weights, prepared.config, str(src))
    prepared.uri, prepared.cache_dir = uri or str(src.resolve()), cache_dir
    prepared.s3_endpoint_url = s3_endpoint_url
    return prepared


def _check_shapes(weights: WeightFiles, config: ModelConfig, source: str) -> None:
    found: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(weights.files.values())):
        try:
            with safe_open(file, "pt") as f:
                found |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from None
    for name, shape in expected_shapes(config).items():
        if name not in found:
            raise ModelLoadError(f"{source}: missing tensor {name!r}")
        if found[name] != shape:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {list(found[name])}, "
                                 f"expected {list(shape)} from the model config")


def shard_slices(config: ModelConfig, shard: RankShard) -> dict[str, tuple[slice, slice]]:
    """HF tensor name -> (rows, columns) of it that `shard` holds; tensors not listed are not
    held at all."""
    every = slice(None)
    q, kv, mlp = shard.rows(config.head_dim)
    vocab = slice(shard.vocab.start, shard.vocab.stop)
    slices: dict[str, tuple[slice, slice]] = {}
    tied = config.tie_word_embeddings
    if shard.is_first_stage or (tied and shard.is_last_stage):
        slices["model.embed_tokens.weight"] = (vocab, every)
    if shard.is_last_stage:
        slices["model.norm.weight"] = (every, every)
        if not tied:
            slices["lm_head.weight"] = (vocab, every)
    for i in shard.layers:
        p = f"model.layers.{i}."
        slices |= {p + "input_layernorm.weight": (every, every),
                   p + "post_attention_layernorm.weight": (every, every),
                   p + "self_attn.q_proj.weight": (q, every),
                   p + "self_attn.k_proj.weight": (kv, every),
                   p + "self_attn.v_proj.weight": (kv, every),
                   p + "self_attn.o_proj.weight": (every, q),
                   p + "mlp.gate_proj.weight": (mlp, every),
                   p + "mlp.up_proj.weight": (mlp, every),
                   p + "mlp.down_proj.weight": (every, mlp)}
        if config.qk_norm:
            slices |= {p + "self_attn.q_norm.weight": (every, every),
                       p + "self_attn.k_norm.weight": (every, every)}
        if config.attention_bias:
            slices |= {p + "self_attn.q_proj.bias": (q, every),
                       p + "self_attn.k_proj.bias": (kv, every),
                       p + "self_attn.v_proj.bias": (kv, every)}
    return slices


def load_shard(weights: WeightFiles, config: ModelConfig, shard: RankShard,
               dtype: str) -> dict[str, Tensor]:
    """The rank's slices, each read alone from its file and converted to `dtype`."""
    torch_dtype = torch_dtype_of(dtype)
    slices = shard_slices(config, shard)
    by_file: dict[str, list[str]] = {}
    for name in slices:
        by_file.setdefault(weights.file_of(name), []).append(name)
    out: dict[str, Tensor] = {}
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in names:
                rows, cols = slices[name]
                part = f.get_slice(name)
                tensor = part[rows] if len(part.get_shape()) == 1 else part[rows, cols]
                out[name] = tensor.to(torch_dtype).contiguous()
    return out
