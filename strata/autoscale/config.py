"""The autoscaler's settings, frozen and validated once (its flags: commands/autoscale_flags.py)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """How one deployment is sized (strata/autoscale/law.py says how each field is used).

    Capacity: the latency profile at the largest batch whose step stays within `itl_slo_s`, for
    requests of `prompt_tokens` and `output_tokens` (the measured correction absorbs a
    different mix). Up: modelled load over `target_utilization` of the fleet, a queue growing
    faster than the model predicts (at once), TTFT p95 over `ttft_slo_s`. Down: to what the load
    needs, only when N-1 replicas stay under `down_utilization` with nothing queued. Dwell: ups at
    least `up_dwell_s` apart (not the fast path), downs `down_dwell_s` apart and `down_after_up_s`
    after an up. Each pool of a deployment (prefill, decode, a class's) is sized on its own
    with these settings; `pool_bounds` (label, min, max) gives a pool other bounds, and
    `class_slos` (class, TTFT p95 s, ITL p95 s) a priority class its own targets: a pool is held
    to the strictest targets of the classes that live in it (`class_pools`, the gateway's
    `--class-pool CLASS=POOL`; a class without one lives in the pools no class names)."""

    min_replicas: int = 1
    max_replicas: int = 8
    interval_s: float = 0.5
    target_utilization: float = 0.9
    down_utilization: float = 0.8
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    prompt_tokens: int = 200
    output_tokens: int = 100
    max_num_seqs: int = 64  # the instances' running-slot cap (strata serve --max-num-seqs)
    up_dwell_s: float = 2.0
    down_dwell_s: float = 30.0
    down_after_up_s: float = 60.0
    window_s: float = 30.0  # the arrival rate is measured over this window
    recent_s: float = 2.0  # ...the recent rate and the backlog's growth over this one
    ttft_window_s: float = 5.0  # ...and TTFT p95 over this one
    drain_backlog_s: float = 10.0  # the fast path sizes the fleet to clear the backlog in this
    lease_s: float = 5.0
    pool_bounds: tuple[tuple[str, int, int], ...] = ()  # --pool-replicas LABEL=MIN:MAX
    class_slos: tuple[tuple[str, float, float], ...] = ()  # --class-slo CLASS=TTFT_S:ITL_S
    class_pools: tuple[tuple[str, str], ...] = ()  # --class-pool CLASS=POOL

    def slos_of(self, pool: str) -> tuple[float, float]:
        """(TTFT p95, ITL p95) targets of the pool named `pool`: the strictest of the classes
        living in it that have targets of their own, else the deployment's."""
        homes = dict(self.class_pools)
        named = set(homes.values())
        living = [(ttft, itl) for klass, ttft, itl in self.class_slos
                  if homes.get(klass) == pool or (klass not in homes and pool not in named)]
        if not living:
            return self.ttft_slo_s, self.itl_slo_s
        return min(t for t, _ in living), min(i for _, i in living)

    def bounds_of(self, label: str) -> tuple[int, int]:
        """(min, max) replicas of the pool `label`."""
        for name, low, high in self.pool_bounds:
            if name == label:
                return low, high
        return self.min_replicas, self.max_replicas

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ConfigError(f"need 0 <= --min-replicas <= --max-replicas and "
                              f"--max-replicas >= 1; got {self.min_replicas} and "
                              f"{self.max_replicas}")
        if not 0 < self.down_utilization < self.target_utilization <= 1:
            raise ConfigError(
                f"need 0 < down utilization ({self.down_utilization}) < target utilization "
                f"({self.target_utilization}) <= 1: the gap is what keeps the fleet from "
                "flapping")
        for name in ("interval_s", "ttft_slo_s", "itl_slo_s", "window_s", "recent_s",
                     "ttft_window_s", "drain_backlog_s",
                     "lease_s", "prompt_tokens", "output_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"autoscaler {name} must be positive, got "
                                  f"{getattr(self, name)}")
        for name in ("up_dwell_s", "down_dwell_s", "down_after_up_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"autoscaler {name} must be >= 0, got {getattr(self, name)}")
        for label, low, high in self.pool_bounds:
            if low < 0 or high < max(1, low):
                raise ConfigError(f"--pool-replicas {label}={low}:{high}: need 0 <= MIN <= MAX "
                                  "and MAX >= 1")
        for klass, ttft_s, itl_s in self.class_slos:
            if ttft_s <= 0 or itl_s <= 0:
                raise ConfigError(f"--class-slo {klass}: targets must be positive, got "
                                  f"{ttft_s}:{itl_s}")
        if self.lease_s < 2 * self.interval_s:
            raise ConfigError(f"the autoscaler's lease ({self.lease_s}s) must outlast two "
                              f"decision intervals ({self.interval_s}s each)")


__all__ = ["AutoscaleConfig"]
