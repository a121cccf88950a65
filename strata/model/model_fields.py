"""The model fields that change the maths, with the values Strata computes.

A checkpoint that sets one of them to another value is refused by name (`ModelLoadError`), never
served with the field ignored: an ignored sliding window, soft-cap or rope scaling loads, answers,
and answers wrongly. Two tables, one per format:

- `config.json` (`check_hf_fields`): only the listed fields are checked, since a config also holds
  many that change nothing (ids, dtype, dropout, initialisation, cache flags).
- GGUF metadata under the architecture's prefix, e.g. `llama.*` (`check_gguf_fields`): every key
  must be listed, since GGUF writers name only hyperparameters: an unknown one is a feature Strata
  lacks.

When a model family implements one of these (a sliding window, soft-capping, partial rotary), its
entry widens to the values it now computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from strata.errors import ModelLoadError

Accepts = Callable[[Any, Mapping[str, Any]], bool]  # (value, every field of the config) -> ok


def _one_of(*values: Any) -> Accepts:
    return lambda value, _cfg: value in values


def _anything(_value: Any, _cfg: Mapping[str, Any]) -> bool:
    return True


def _hf_full_attention(window: Any, cfg: Mapping[str, Any]) -> bool:
    """A window is full attention when it is off (Qwen2's `use_sliding_window: false`) or at
    least as long as the context."""
    return (window is None or cfg.get("use_sliding_window") is False
            or int(window) >= int(cfg.get("max_position_embeddings") or 0))


def _hf_full_layers(layer_types: Any, _cfg: Mapping[str, Any]) -> bool:
    return layer_types is None or all(t == "full_attention" for t in layer_types)


# config.json field (a dotted name looks inside a dict) -> (accepts, what Strata computes).
HF_FIELDS: dict[str, tuple[Accepts, str]] = {
    "hidden_act": (_one_of("silu"), "'silu' (a SwiGLU MLP)"),
    "hidden_activation": (_one_of(None, "silu"), "'silu' (a SwiGLU MLP)"),
    "mlp_bias": (_one_of(None, False), "false (no MLP biases)"),
    # HF Llama's attention_bias adds an o_proj bias too; Strata has biases on q, k, v (Qwen2).
    "attention_bias": (_one_of(None, False), "false (Llama and Mistral have no attention biases)"),
    "sliding_window": (_hf_full_attention, "full attention (no window, or one as long as "
                       "max_position_embeddings)"),
    "layer_types": (_hf_full_layers, "every layer 'full_attention'"),
    "attn_logit_softcapping": (_one_of(None), "no soft-capping of attention scores"),
    "final_logit_softcapping": (_one_of(None), "no soft-capping of logits"),
    "query_pre_attn_scalar": (_one_of(None), "scores scaled by head_dim ** -0.5"),
    "partial_rotary_factor": (_one_of(None, 1, 1.0), "rotary over the whole head (1.0)"),
    "rope_parameters.partial_rotary_factor": (_one_of(None, 1, 1.0),
                                              "rotary over the whole head (1.0)"),
    "rope_scaling.partial_rotary_factor": (_one_of(None, 1, 1.0),
                                           "rotary over the whole head (1.0)"),
    "quantization_config": (_one_of(None), "float weights (no quantized checkpoints)"),
}


def check_hf_fields(cfg: Mapping[str, Any], *, source: str) -> None:
    """Raise naming the first field of `cfg` whose value Strata does not compute."""
    for name, (accepts, computed) in HF_FIELDS.items():
        value = _lookup(cfg, name)
        if value is not None and not accepts(value, cfg):
            raise ModelLoadError(
                f"{source}: field {name!r} = {value!r} is not implemented by Strata "
                f"(it computes {computed})"
            )


def _lookup(cfg: Mapping[str, Any], dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _gguf_head_dim(fields: Mapping[str, Any]) -> int:
    default = int(fields["embedding_length"]) // int(fields["attention.head_count"])
    return int(fields.get("attention.key_length", default))


def _gguf_is_head_dim(value: Any, fields: Mapping[str, Any]) -> bool:
    return int(value) == _gguf_head_dim(fields)


def _gguf_full_attention(window: Any, fields: Mapping[str, Any]) -> bool:
    return int(window) == 0 or int(window) >= int(fields["context_length"])


# GGUF key after "{arch}." -> (accepts, what Strata computes). Keys read into ModelConfig accept
# anything; the rest hold Strata to the maths it has.
GGUF_FIELDS: dict[str, tuple[Accepts, str]] = {
    **{key: (_anything, "read") for key in (
        "vocab_size", "context_length", "embedding_length", "feed_forward_length",
        "block_count", "attention.head_count", "attention.head_count_kv",
        "attention.key_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
        # informative: only the scalings refused below read them
        "rope.scaling.original_context_length", "rope.scaling.finetuned",
        "tensor_data_layout",
    )},
    "attention.value_length": (_gguf_is_head_dim, "values as long as keys (head_dim)"),
    "rope.dimension_count": (_gguf_is_head_dim, "rotary over the whole head (head_dim)"),
    # Llama-3 scaling travels as the `rope_freqs` tensor; llama.cpp reads a factor without a
    # type as linear scaling.
    "rope.scaling.type": (_one_of("none"), "no rope scaling other than the rope_freqs tensor"),
    "rope.scaling.factor": (_one_of(0.0, 1.0), "no linear or YaRN rope scaling"),
    "rope.scaling.attn_factor": (_one_of(1.0), "unscaled attention (1.0)"),
    "attention.sliding_window": (_gguf_full_attention, "full attention (no window, or one as "
                                 "long as the context)"),
    "expert_count": (_one_of(0), "a dense MLP (no experts)"),
    "expert_used_count": (_one_of(0), "a dense MLP (no experts)"),
}


def check_gguf_fields(fields: Mapping[str, Any], arch: str, *, source: str) -> None:
    """`fields`: every `{arch}.*` metadata key without the prefix -> its value. Raise naming
    the first key Strata does not know or whose value it does not compute."""
    for key, value in fields.items():
        entry = GGUF_FIELDS.get(key)
        if entry is None:
            raise ModelLoadError(
                f"{source}: GGUF metadata field '{arch}.{key}' = {value!r} is not implemented "
                "by Strata (an unknown hyperparameter)"
            )
        accepts, computed = entry
        if not accepts(value, fields):
            raise ModelLoadError(
                f"{source}: GGUF metadata field '{arch}.{key}' = {value!r} is not implemented "
                f"by Strata (it computes {computed})"
            )
