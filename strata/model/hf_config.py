"""Translate a Hugging Face `config.json` into Strata's `ModelConfig`."""

from __future__ import annotations

from typing import Any

from strata.errors import ModelLoadError
from strata.model.config import ModelConfig, RopeScaling
from strata.model.model_fields import check_hf_fields

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}


def model_config_from_hf(cfg: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig; errors name `source` and the field at fault."""
    arch = _architecture(cfg, source)
    _refuse_unsupported_variants(cfg, arch, source)
    try:
        check_hf_fields(cfg, source=source)  # a field Strata does not compute is refused
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(_rope_theta(cfg)),
            rope_scaling=_rope_scaling(cfg, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: invalid value: {e}") from None


def _architecture(cfg: dict[str, Any], source: str) -> str:
    names = cfg.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in _ARCHITECTURES.values():
        return str(model_type)
    raise ModelLoadError(
        f"{source}: field 'architectures' = {names!r} (model_type {model_type!r}) is not "
        f"supported; Strata serves {sorted(_ARCHITECTURES)}"
    )


def _refuse_unsupported_variants(cfg: dict[str, Any], arch: str, source: str) -> None:
    """Options of the new families that Strata does not implement: a load error naming them,
    never a model that silently computes something else."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ModelLoadError(f"{source}: field 'partial_rotary_factor' = {partial!r} is not "
                             "supported (only 1.0)")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: field 'use_sliding_window' = true is not supported")


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any], source: str) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(
            f"{source}: field 'rope_scaling.rope_type' = {kind!r} is not supported "
            "(only 'llama3' and 'default')"
        )
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )
