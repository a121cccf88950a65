"""Frozen, validated architecture of a Llama-family model: what the model layer needs to build
the weights' shapes, RoPE and the KV cache. The engine never sees it: it meets the model only
through `ModelExecutor` (`kv_bytes_per_token` sizes the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family model (Llama, Qwen2, Qwen3, Mistral, Phi-3)."""

    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of the inverse frequencies (head_dim / 2 of them): a GGUF file's
    # `rope_freqs` tensor, which is how llama.cpp's converter stores Llama-3 scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"Strata serves {', '.join(ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_rope()

    def _check_rope(self) -> None:
        factors = self.rope_freq_factors
        if factors is None:
            return
        if self.rope_scaling is not None:
            raise ConfigError("rope_scaling and rope_freq_factors are two forms of one scaling: "
                              "give one")
        if len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors):
            raise ConfigError(f"rope_freq_factors must be head_dim / 2 = {self.head_dim // 2} "
                              f"positive numbers, got {len(factors)}")

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V for one token across all layers."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[dtype]
        return per_layer * self.num_hidden_layers
