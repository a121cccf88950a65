"""The costs outside an engine step that a plan charges, with where each number comes from.

    request_overhead_ms    HTTP, JSON, tokenization and the gateway hop before a request reaches
                           the engine (docs/benchmarks.md, gateway overhead: a few ms here)
    request_overhead_samples_ms  measured overheads (a calibration's round trips less their
                           engine time, bench/plan_calibrate.py): each request draws one, so
                           the plan carries the spread of a real path, not only its mean
    session_read_ms        reading a session's history from the store (SQLite/Redis, local)
    kv_fetch_ms_per_token  KV offload: a fetch from Redis on this host and the import, per token
                           (bench/kv_offload.py: (fetch - local hit) / tokens, 0.03-0.05 ms for
                           256-1024 tokens: ~23 KB of SmolLM2 KV per token)
    kv_min_fetch_tokens    the server's --kv-min-fetch-tokens default: shorter prompts recompute
    transfer_ms_base       P/D: the hand-off's fixed cost, the extra hops (bench/pd_transfer.py:
                           +22-27 ms of remote over local TTFT at 32-128 tokens; the gateway's
                           decider assumes 15 ms)
    transfer_ms_per_token  P/D: the decode side pulling the prefilled blocks (bench/pd_transfer.py:
                           43-60 us per token at 512-4,096 tokens over loopback, ~0.5 GB/s)
    pd_min_uncached_tokens P/D: shorter prompts stay on the decode instance (None: the gateway's
                           default, `fit_min_uncached_tokens` of the profile)
    start_s                an autoscaled instance's start until it is ready (bench/autoscale.py)
    session_consistency    the session store's level (`strata serve --session-consistency`):
                           `strong` writes each turn before the answer ends, so a turn lasts
                           `session_write_ms` longer and a session's next turn starts that much
                           later; `session` and `eventual` write behind the answer (nothing on
                           the turn's path; what a crash may lose instead: docs/consistency.md)
    session_write_ms       one turn's compare-and-set on the store (bench/session_levels.py
                           price, single Redis, 2-core machine: store p50 13.7 ms at strong)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from strata.errors import ConfigError
from strata.plan.instance import TensorParallel
from strata.sim.profile import LatencyProfile
from strata.sim.transfer import fit_min_uncached_tokens
from strata.state.sessions import CONSISTENCY_LEVELS

SESSION_WRITE_MS = 13.7  # bench/session_levels.py price: store p50 at strong, single Redis
HANDOFF_OVERHEAD_MS = 15.0  # what the gateway's default --pd-min-uncached-tokens assumes


@dataclass(frozen=True, slots=True)
class Costs:
    request_overhead_ms: float = 2.0
    request_overhead_samples_ms: tuple[float, ...] = ()
    session_read_ms: float = 1.0
    kv_fetch_ms_base: float = 2.0
    kv_fetch_ms_per_token: float = 0.04
    kv_min_fetch_tokens: int = 256
    transfer_ms_base: float = HANDOFF_OVERHEAD_MS
    transfer_ms_per_token: float = 0.046
    pd_min_uncached_tokens: int | None = None
    start_s: float = 5.0
    session_consistency: str = "strong"
    session_write_ms: float = SESSION_WRITE_MS
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)

    def __post_init__(self) -> None:
        for name in ("request_overhead_ms", "session_read_ms", "kv_fetch_ms_base",
                     "kv_fetch_ms_per_token", "transfer_ms_base", "transfer_ms_per_token",
                     "start_s", "session_write_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"plan cost {name} must be >= 0, got {getattr(self, name)}")
        if any(sample < 0 for sample in self.request_overhead_samples_ms):
            raise ConfigError("plan cost request_overhead_samples_ms must all be >= 0")
        if self.session_consistency not in CONSISTENCY_LEVELS:
            raise ConfigError(f"session consistency is one of {', '.join(CONSISTENCY_LEVELS)}, "
                              f"got {self.session_consistency!r}")

    def request_overhead(self, rng: random.Random) -> float:
        """One request's overhead in ms: a measured sample, else the constant."""
        samples = self.request_overhead_samples_ms
        return rng.choice(samples) if samples else self.request_overhead_ms

    def session_write_s(self, sessions: str | None) -> float:
        """Seconds a turn's store write adds to the turn: only a store (sessions external or
        hybrid) written before the answer (`strong`)."""
        if sessions not in ("external", "hybrid") or self.session_consistency != "strong":
            return 0.0
        return self.session_write_ms / 1000

    def kv_fetch_ms(self, num_tokens: int) -> float:
        return self.kv_fetch_ms_base + self.kv_fetch_ms_per_token * num_tokens

    def pd_min_tokens(self, profile: LatencyProfile) -> int:
        if self.pd_min_uncached_tokens is not None:
            return self.pd_min_uncached_tokens
        return fit_min_uncached_tokens(profile, handoff_overhead_ms=HANDOFF_OVERHEAD_MS)

    def transfer_ms(self, num_tokens: int) -> float:
        return self.transfer_ms_base + self.transfer_ms_per_token * num_tokens


__all__ = ["Costs"]
