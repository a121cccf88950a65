"""Frozen, validated configuration of the engine layer.

Each component receives only its own config; `cli.py` composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family model (Llama, Qwen2, Mistral)."""

    architecture: str  # "llama" | "qwen2" | "mistral"
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
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "qwen2", "mistral"):
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; "
                "Strata serves llama, qwen2 and mistral"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V for one token across all layers."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[dtype]
        return per_layer * self.num_hidden_layers


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache and prefix cache."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    namespace: str = ""  # model name and version: part of every block hash

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size > 1024:
            raise ConfigError(f"block_size must be in 1..1024, got {self.block_size}")
        if self.num_blocks < 2:
            raise ConfigError(
                f"the KV cache holds only {self.num_blocks} blocks; raise --kv-cache-gb"
            )

    @staticmethod
    def blocks_for_gb(kv_cache_gb: float, bytes_per_token: int, block_size: int) -> int:
        """How many blocks fit in `kv_cache_gb` GiB."""
        if kv_cache_gb <= 0:
            raise ConfigError(f"--kv-cache-gb must be positive, got {kv_cache_gb}")
        return int(kv_cache_gb * (1 << 30)) // (bytes_per_token * block_size)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting: int = 1024  # beyond this new requests are refused (OverloadedError)

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_model_len <= 1:
            raise ConfigError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
