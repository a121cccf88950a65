"""Configuration of the OpenAI-compatible instance server."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError


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
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    rate_limit_per_s: float | None = None  # per API key
    model_version: str = "default"  # stored with each session
    session_store_url: str | None = None  # memory://, sqlite:///PATH, redis://...; None: off
    session_ttl_s: float | None = 86_400.0  # sliding: each stored turn restarts it; None: never
    session_redis_appendfsync: str | None = None  # "always": CONFIG SET AOF on the Redis store

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
        if self.retry_after_s <= 0:
            raise ConfigError(f"retry_after_s must be positive, got {self.retry_after_s}")


__all__ = ["ServerConfig"]
