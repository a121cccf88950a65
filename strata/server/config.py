"""Configuration of the OpenAI-compatible instance server."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import ConfigError
from strata.model.generation_defaults import GenerationDefaults
from strata.server.pd.config import PDConfig
from strata.state.kv_store import KVStoreLimits
from strata.state.sessions import SessionStoreOptions


@dataclass(frozen=True, slots=True)
class EmbedConfig:
    """What POST /v1/embeddings needs to know of the encoder an embed instance serves.

    `dimensions` in a request is taken only for a Matryoshka-trained model (`is_matryoshka`;
    `matryoshka_dimensions` lists the sizes it was trained at, empty: any size up to the full
    one): the vector is truncated and renormalized. Otherwise only the full size is accepted.
    """

    num_dimensions: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_dimensions < 1:
            raise ConfigError(f"num_dimensions must be >= 1, got {self.num_dimensions}")

    def allows(self, dimensions: int) -> bool:
        if dimensions == self.num_dimensions:
            return True
        if not self.is_matryoshka or not 1 <= dimensions < self.num_dimensions:
            return False
        return not self.matryoshka_dimensions or dimensions in self.matryoshka_dimensions


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-level settings and per-request parameter limits.

    The waiting-queue bound lives in the engine (`SchedulerConfig.max_waiting`); the server only
    maps the engine's refusal to 429 with `retry_after_s`.
    """

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_top_logprobs: int = 20
    max_stop_strings: int = 16
    shutdown_timeout_s: float = 30.0
    retry_after_s: float = 1.0
    drain_poll_s: float = 0.05  # how often a drain checks whether in-flight requests are done
    simulated: bool = False  # a latency model stands in for the maths: always labelled
    # one matmul kernel at every batch size (`strata serve --deterministic`, by default for
    # quantized weights: determinism.deterministic_by_default): a request's
    # tokens do not depend on its batch or cached prefix; /v1/models says so
    deterministic: bool = False
    api_keys: tuple[str, ...] = ()  # client keys; no key of any kind: no authentication
    admin_keys: tuple[str, ...] = ()  # the operator's (strata/protocol/keys.py)
    internal_keys: tuple[str, ...] = ()  # the fleet's: hand-offs, resumes, feeds, drains
    rate_limit_per_s: float | None = None  # per API key
    key_max_priority: tuple[tuple[str, int], ...] = ()  # (key, priority ceiling) pairs
    model_version: str = "default"  # stored with each session
    session_store_url: str | None = None  # memory://, sqlite:///PATH, redis://...; None: off
    session_ttl_s: float | None = 86_400.0  # sliding: each stored turn restarts it; None: never
    session_redis_appendfsync: str | None = None  # "always": CONFIG SET AOF on the Redis store
    session_redis_replicas: int = 0  # a stored turn is acknowledged once this many replicas hold it
    # strong: stored before acknowledged; session/eventual: written behind (write_behind.py),
    # at most session_write_queue turns queued and, at session, none older than the bound
    session_consistency: str = "strong"
    session_flush_bound_s: float = 0.2
    session_write_queue: int = 1024
    # KV offload (kv_offload.py): publish finished requests' KV blocks to the store, fetch
    # missing prefixes from it. Prompts shorter than kv_min_fetch_tokens never fetch.
    kv_offload: bool = False
    kv_store_url: str | None = None  # memory://, redis://...
    kv_ttl_s: float | None = 3600.0
    kv_max_block_bytes: int = 16 << 20
    kv_max_put_bytes: int = 256 << 20
    kv_min_fetch_tokens: int = 256
    kv_redis_maxmemory_bytes: int | None = None  # set: CONFIG SET maxmemory + allkeys-lru
    # the model's sampling defaults for fields a request leaves out (--generation-config auto)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    pd: PDConfig = field(default_factory=PDConfig)  # prefill/decode hand-off (pd/state.py)
    # set: an embed instance (`strata serve --task embed`): /v1/embeddings, no generation
    embed: EmbedConfig | None = None
    # LoRA adapters served beside the base (--lora-modules): name -> content digest; changed
    # at run time by POST /v1/load_lora_adapter and /v1/unload_lora_adapter only (lora_routes.py)
    loras: dict[str, str] = field(default_factory=dict)
    # every adapter known, resident or not: name -> path (strata/server/loras.py)
    lora_paths: dict[str, str] = field(default_factory=dict)
    # at most this many adapters resident; others load on demand, evicting the least recently
    # used one nobody holds (--max-cpu-loras; None: every known adapter stays resident)
    max_cpu_loras: int | None = None

    @property
    def task(self) -> str:
        """"embed" or "generate": which routes this instance serves (/v1/models shows it)."""
        return "generate" if self.embed is None else "embed"

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("served_model_name must not be empty; pass --served-model-name")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_body_bytes", "max_n", "max_stop_strings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_top_logprobs < 0:
            raise ConfigError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.drain_poll_s <= 0:
            raise ConfigError(f"drain_poll_s must be positive, got {self.drain_poll_s}")
        if self.session_ttl_s is not None and self.session_ttl_s <= 0:
            raise ConfigError(f"session_ttl_s must be positive, got {self.session_ttl_s}; "
                              "pass None for sessions that never expire")
        SessionStoreOptions(  # the session store's options, checked before the lifespan opens it
            redis_appendfsync=self.session_redis_appendfsync,
            redis_replicas=self.session_redis_replicas, consistency=self.session_consistency,
            flush_bound_s=self.session_flush_bound_s, max_pending=self.session_write_queue)
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ConfigError(f"max_cpu_loras must be >= 1 (or None), got {self.max_cpu_loras}")
        if self.retry_after_s <= 0:
            raise ConfigError(f"retry_after_s must be positive, got {self.retry_after_s}")
        if self.kv_offload and not self.kv_store_url:
            raise ConfigError("KV offload needs a KV store: pass --kv-store URL "
                              "(memory:// or redis://HOST:PORT/DB)")
        if self.kv_min_fetch_tokens < 0:
            raise ConfigError(f"kv_min_fetch_tokens must be >= 0, got {self.kv_min_fetch_tokens}")
        self.kv_limits()  # validates the store limits

    def kv_limits(self) -> KVStoreLimits:
        return KVStoreLimits(ttl_s=self.kv_ttl_s, max_block_bytes=self.kv_max_block_bytes,
                             max_put_bytes=self.kv_max_put_bytes,
                             redis_maxmemory_bytes=self.kv_redis_maxmemory_bytes)


__all__ = ["EmbedConfig", "ServerConfig"]
