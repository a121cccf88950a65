"""Frozen, validated configuration of the engine layer.

Each component receives only its own config; `cli.py` composes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError


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
    # aging: a request (not sheddable) waiting this long ranks with the top class; None: off
    max_queue_wait_s: float | None = None
    # While decodes run, a long prompt's chunks (a prompt over the token budget) are capped so
    # that a step lasts at most about this many decode steps (measured: step_budget.py); short
    # prompts are never capped. 0 (the default) turns the cap off: at 1.5 a 1,500-token prompt
    # beside 16 decodes costs that run 10 % of its throughput (docs/benchmarks.md, speed round 2).
    prefill_stretch: float = 0.0
    # distinct LoRA adapters in one step; rows of further adapters wait, in order (None: any)
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras <= 0:
            raise ConfigError(f"max_loras must be positive (or None), got {self.max_loras}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_queue_wait_s is not None and self.max_queue_wait_s <= 0:
            raise ConfigError(f"max_queue_wait_s must be positive (or None: no aging), got "
                              f"{self.max_queue_wait_s}")
        if self.max_model_len <= 1:
            raise ConfigError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if self.prefill_stretch != 0 and self.prefill_stretch <= 1.0:
            raise ConfigError(f"prefill_stretch must be 0 (off) or > 1, got {self.prefill_stretch}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
