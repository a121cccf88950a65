"""Load a model from a Hugging Face directory or a GGUF file into one weight dict.

Both sources end in the same `LoadedModel`: a `ModelConfig`, weights under Hugging Face parameter
names in the requested dtype (`lm_head.weight` absent when embeddings are tied), and a `Tokenizer`.
Every malformed input raises `ModelLoadError` naming the file and the field or tensor at fault.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from strata.errors import ConfigError, ModelLoadError
from strata.model.config import ModelConfig
from strata.model.generation_defaults import GenerationDefaults, read_generation_defaults
from strata.model.gguf_cache import load_gguf
from strata.model.hf_config import model_config_from_hf
from strata.model.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    """A model ready to serve: architecture, weights and tokenizer."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str  # default served name: the directory name or the GGUF `general.name`
    source: Path
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


def load_model(
    path: str | Path, *, dtype: str = "bfloat16", cache_dir: Path | None = None
) -> LoadedModel:
    """Load an HF model directory or a `.gguf` file.

    GGUF tensors are dequantized once and cached as safetensors under `cache_dir` (no cache when
    it is None); a later load of the same unchanged file reads the cache.
    """
    torch_dtype = torch_dtype_of(dtype)
    src = Path(path)
    if src.is_dir():
        model = _load_hf_dir(src, torch_dtype)
    elif src.is_file():
        g = load_gguf(src, dtype=torch_dtype, cache_dir=cache_dir)
        model = LoadedModel(g.config, g.weights, g.tokenizer, g.name, g.source)
    else:
        raise ModelLoadError(f"{src}: no such model directory or .gguf file")
    check_weights(model.weights, model.config, source=str(src))
    model.generation_defaults = read_generation_defaults(src)
    return model


def torch_dtype_of(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Llama-family model with its shape, under HF names."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            "mlp.up_proj.weight": (cfg.intermediate_size, h),
            "mlp.down_proj.weight": (h, cfg.intermediate_size),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,)}
            layer |= {"self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        shapes |= {p + k: v for k, v in layer.items()}
    return shapes


def split_fused(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Phi-3 keeps q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj`: split them
    (views, no copy) into the Llama names the model reads."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = weights.pop(p + "self_attn.qkv_proj.weight", None)
        if qkv is not None:
            for name, part in zip("qkv", qkv.split([q, kv, kv]), strict=True):
                weights[f"{p}self_attn.{name}_proj.weight"] = part
        gate_up = weights.pop(p + "mlp.gate_up_proj.weight", None)
        if gate_up is not None:
            gate, up = gate_up.split(cfg.intermediate_size)
            weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"] = gate, up


def check_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, *, source: str) -> None:
    """Drop tensors the model does not use; raise on a missing tensor or a wrong shape."""
    shapes = expected_shapes(cfg)
    for name in [n for n in weights if n not in shapes]:
        del weights[name]  # e.g. rotary inv_freq buffers, or lm_head when tied
    for name, shape in shapes.items():
        if name not in weights:
            raise ModelLoadError(f"{source}: missing tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {list(weights[name].shape)}, expected "
                f"{list(shape)} from the model config"
            )


def _load_hf_dir(path: Path, dtype: torch.dtype) -> LoadedModel:
    config = _hf_config(path)
    weights = _load_safetensors(path, dtype)
    if config.architecture == "phi3":
        split_fused(weights, config)
    config, tokenizer = _with_tokenizer(path, config)
    return LoadedModel(config, weights, tokenizer, name=path.resolve().name, source=path)


def hf_config_and_tokenizer(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """An HF directory's config (eos and bos merged from every file that names them) and
    tokenizer, without reading any weights."""
    return _with_tokenizer(path, _hf_config(path))


def _hf_config(path: Path) -> ModelConfig:
    return model_config_from_hf(read_json(path / "config.json"), source=str(path / "config.json"))


def _with_tokenizer(path: Path, config: ModelConfig) -> tuple[ModelConfig, Tokenizer]:
    tokenizer = _load_hf_tokenizer(path, config)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    config = dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)
    tokenizer.eos_token_ids = eos
    return config, tokenizer


def safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file of an HF directory (its index, or the one model.safetensors); the
    single file's names are {"*": file}."""
    index = path / INDEX_FILE
    if not index.exists():
        single = path / "model.safetensors"
        if not single.exists():
            raise ModelLoadError(f"{path}: no model.safetensors and no {INDEX_FILE}")
        return {"*": single}
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index}: missing field 'weight_map'")
    return {name: path / shard for name, shard in weight_map.items()}


def _load_safetensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    files = safetensors_files(path)
    if "*" in files:
        return {k: v.to(dtype) for k, v in _read_safetensors(files["*"]).items()}
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(files.values())):
        tensors = _read_safetensors(shard)
        for name in (n for n, s in files.items() if s == shard):
            if name not in tensors:
                raise ModelLoadError(f"{shard}: missing tensor {name!r} (listed in {INDEX_FILE})")
            weights[name] = tensors[name].to(dtype)
    return weights


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.exists():
        raise ModelLoadError(f"{file}: weight file is missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from None


def _load_hf_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        raise ModelLoadError(f"{path}: missing tokenizer.json (Strata needs a fast tokenizer)")
    tok_cfg = read_json(path / "tokenizer_config.json", required=False)
    gen_cfg = read_json(path / "generation_config.json", required=False)
    eos_ids = (*config.eos_token_ids, *_ids(gen_cfg.get("eos_token_id")))
    return Tokenizer.from_file(
        tok_file,
        chat_template=_chat_template(path, tok_cfg),
        eos_token_ids=eos_ids,
        bos_token=_token_text(tok_cfg.get("bos_token")),
        eos_token=_token_text(tok_cfg.get("eos_token")),
    )


def _chat_template(path: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def read_json(file: Path, *, required: bool = True) -> dict[str, Any]:
    """A JSON object from `file` ({} when optional and absent); errors name the file."""
    if not file.exists():
        if required:
            raise ModelLoadError(f"{file}: file is missing")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object")
    return data
