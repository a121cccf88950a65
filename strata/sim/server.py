"""A simulated instance: the real Engine, scheduler and prefix cache over a `SimulatedExecutor`.

`strata serve --simulate PROFILE.json` builds its engine here and serves it with the ordinary
`create_app` (with `ServerConfig(simulated=True)` so /v1/models and /metrics say so). Nothing on
this path imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from strata.clock import Clock
from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.model.tokenizer import Tokenizer
from strata.server.async_engine import AsyncEngine
from strata.sim.executor import SimulatedExecutor
from strata.sim.profile import LatencyProfile
from strata.sim.tokenizer import build_sim_tokenizer, word_token_ids
from strata.sim.transfer import DEFAULT_BANDWIDTH_GBPS

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_KV_BYTES_PER_TOKEN = 23040  # SmolLM2-135M in bfloat16: 30 layers x 2 x 3 heads x 64 x 2


def sim_kv_blocks(profile: LatencyProfile, kv_cache_gb: float, block_size: int) -> int:
    """How many blocks `--kv-cache-gb` buys for the profiled model (as `strata serve` counts)."""
    bytes_per_token = profile.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN
    return CacheConfig.blocks_for_gb(kv_cache_gb, bytes_per_token, block_size)


@dataclass(frozen=True, slots=True)
class SimulatedEngineParts:
    """What `build_simulated_engine` made, for tests and the CLI's log line."""

    engine: Engine
    executor: SimulatedExecutor
    tokenizer: Tokenizer


def build_simulated_engine(
    profile: LatencyProfile, *, max_num_seqs: int = 64, kv_blocks: int = 4096,
    block_size: int = 16, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
    max_waiting: int = 1024, namespace: str = "", seed: int = 0,
    sleep: Callable[[float], None] = time.sleep, max_queue_wait_s: float | None = None,
    clock: Clock = time.monotonic,
    kv_bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS,
) -> SimulatedEngineParts:
    """A real `Engine` whose executor sleeps for the profile's step times (and for a hand-off's
    transfer at `kv_bandwidth_gbps`)."""
    tokenizer = build_sim_tokenizer()
    executor = SimulatedExecutor(profile, tokenizer.vocab_size, sleep=sleep, seed=seed,
                                 token_ids=word_token_ids(tokenizer),
                                 kv_bandwidth_gbps=kv_bandwidth_gbps)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, max_waiting=max_waiting, max_queue_wait_s=max_queue_wait_s)
    cache_config = CacheConfig(block_size=block_size, num_blocks=kv_blocks,
                               enable_prefix_caching=enable_prefix_caching,
                               namespace=namespace or f"{profile.model}@simulated")
    engine = Engine(executor, cache_config, scheduler_config, tokenizer,
                    vocab_size=tokenizer.vocab_size, clock=clock)
    return SimulatedEngineParts(engine, executor, tokenizer)


def build_simulated_async_engine(parts: SimulatedEngineParts) -> tuple[AsyncEngine, Tokenizer]:
    """(AsyncEngine, tokenizer) of a simulated instance, ready for `create_app`."""
    max_model_len = parts.engine.scheduler_config.max_model_len
    return AsyncEngine(parts.engine, max_model_len=max_model_len), parts.tokenizer
