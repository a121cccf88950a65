"""What one simulated architecture predicts, and why it misses the SLO when it does.

The bottleneck is read from the run, in this order (the first that holds is named):

    prefill floor   the prompt's prefill alone, unloaded, exceeds the TTFT bound: no number
                    of replicas helps, only a faster step (TP) or fewer tokens to compute
    decode floor    a decode step at batch 1 exceeds the TPOT bound: likewise
    scale-up lag    (autoscaled) the SLO was missed while the fleet grew
    KV cache        requests were preempted (the cache ran out of blocks)
    prefix recompute  the prefix-hit rate is > 10 points under the best configuration's:
                    prompt tokens are recomputed that another placement would have hit
    compute         the instances were busy >= 85 % of the run: requests queue for steps
    imbalance       the busiest instance worked > 1.25x the mean
    queueing        what remains: bursts queue behind prefills (TTFT) or share decode steps
                    with prefills (TPOT)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.bench.report import percentile
from strata.plan.arch import Architecture
from strata.plan.fleet import FleetResult
from strata.plan.workload import Slo, Workload
from strata.sim.profile import LatencyProfile

PERCENTILES = (50, 90, 99)
BUSY_LIMIT = 0.85
IMBALANCE_LIMIT = 1.25


@dataclass(slots=True)
class Outcome:
    arch: Architecture
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    turn_ms: dict[str, float]  # arrival until the turn ended (its store write included)
    output_tokens_per_s: float
    requests_per_s: float
    instances: float  # mean instances paid for over the run (autoscaled: < the most)
    ranks: float
    utilization: float
    prefix_hit_rate: float
    num_preemptions: int
    num_requests: int
    meets_slo: bool = False
    bottleneck: str = ""
    wall_s: float = 0.0
    is_stopped_early: bool = False  # the figures cover the requests done when it was stopped

    def to_json(self) -> dict[str, Any]:
        return {"config": self.arch.label, "step": self.arch.step, "policy": self.arch.policy,
                "replicas": self.arch.replicas, "prefill_instances": self.arch.num_prefill,
                "tp": self.arch.tp, "sessions": self.arch.sessions,
                "kv_offload": self.arch.kv_offload, "autoscaled": self.arch.autoscale,
                "instances": round(self.instances, 2), "ranks": round(self.ranks, 2),
                "ttft_ms": _rounded(self.ttft_ms), "tpot_ms": _rounded(self.tpot_ms),
                "turn_ms": _rounded(self.turn_ms),
                "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "requests_per_s": round(self.requests_per_s, 3),
                "utilization": round(self.utilization, 3),
                "prefix_hit_rate": round(self.prefix_hit_rate, 3),
                "num_preemptions": self.num_preemptions, "num_requests": self.num_requests,
                "meets_slo": self.meets_slo, "bottleneck": self.bottleneck,
                "stopped_early": self.is_stopped_early, "simulated_in_s": round(self.wall_s, 3)}


def _rounded(stats: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in stats.items()}


_KEYS = tuple(f"p{q}" for q in PERCENTILES)


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    return {key: percentile(values_s, q) * 1000 for key, q in zip(_KEYS, PERCENTILES,
                                                                    strict=True)}


def outcome(arch: Architecture, run: FleetResult, slo: Slo) -> Outcome:
    done = [(t, t.first_token_s, t.finish_s) for t in run.turns
            if t.first_token_s is not None and t.finish_s is not None]
    ttfts = [first - t.arrival_s for t, first, _ in done]
    tpots = [(end - first) / (t.num_output_tokens - 1) for t, first, end in done
             if t.num_output_tokens > 1]
    turns = [(t.answered_s or end) - t.arrival_s for t, _, end in done]
    start = min((t.arrival_s for t, _, _ in done), default=0.0)
    span = max(max((end for _, _, end in done), default=0.0) - start, 1e-9)
    num_prompt = sum(t.num_prompt_tokens for t, _, _ in done)
    instances = run.instance_seconds / max(run.duration_s, 1e-9)
    out = Outcome(
        arch, _stats_ms(ttfts), _stats_ms(tpots) if tpots else dict.fromkeys(_KEYS, 0.0),
        _stats_ms(turns),
        output_tokens_per_s=sum(t.num_output_tokens for t, _, _ in done) / span,
        requests_per_s=len(done) / span, instances=instances, ranks=instances * arch.tp,
        utilization=min(1.0, run.busy_seconds / max(run.instance_seconds, 1e-9)),
        prefix_hit_rate=sum(t.num_cached_tokens for t, _, _ in done) / max(num_prompt, 1),
        num_preemptions=run.num_preemptions, num_requests=len(run.turns))
    out.is_stopped_early = run.is_stopped_early
    out.meets_slo = not run.is_stopped_early and len(done) == len(run.turns) and \
        percentile(ttfts, slo.ttft_percentile) * 1000 <= slo.ttft_ms and \
        (not tpots or percentile(tpots, slo.tpot_percentile) * 1000 <= slo.tpot_ms)
    return out


def diagnose(out: Outcome, run: FleetResult, slo: Slo, workload: Workload,
             profile: LatencyProfile, best_hit_rate: float) -> str:
    """The bottleneck that makes `out` miss the SLO ("" when it meets it)."""
    if out.meets_slo:
        return ""
    misses = "TTFT" if out.ttft_ms.get(f"p{slo.ttft_percentile:g}", _ttft_ms(run, slo)) \
        > slo.ttft_ms else "TPOT"
    prompt = workload.prompt.mean + workload.prefix_tokens
    floor_ms = profile.step_ms(min(int(prompt), 512), 0) * max(1.0, prompt / 512)
    if misses == "TTFT" and floor_ms > slo.ttft_ms and out.prefix_hit_rate < 0.5:
        return f"prefill floor: {prompt:.0f} prompt tokens take {floor_ms:.0f} ms unloaded"
    if misses == "TPOT" and profile.step_ms(0, 1, int(prompt)) > slo.tpot_ms:
        return f"decode floor: one decode step takes {profile.step_ms(0, 1, int(prompt)):.0f} ms"
    if out.arch.autoscale:
        return (f"scale-up lag: the fleet grew from 1 to {run.max_instances} instances, each "
                f"ready only after its start ({misses} over the SLO meanwhile)")
    if out.num_preemptions:
        return f"KV cache: {out.num_preemptions} preemptions ({misses} over the SLO)"
    if best_hit_rate - out.prefix_hit_rate > 0.1:
        return (f"prefix recompute: hit rate {out.prefix_hit_rate:.0%} against "
                f"{best_hit_rate:.0%} elsewhere, instances {out.utilization:.0%} busy "
                f"({misses} over the SLO)")
    if out.utilization >= BUSY_LIMIT:
        return f"compute: instances {out.utilization:.0%} busy ({misses} over the SLO)"
    busy = run.busy_by_instance
    if len(busy) > 1 and max(busy) > IMBALANCE_LIMIT * (sum(busy) / len(busy)):
        return f"imbalance: busiest instance {max(busy) / (sum(busy) / len(busy)):.2f}x mean"
    what = "prefills queue in bursts" if misses == "TTFT" else "decode shares steps with prefills"
    return f"queueing: {misses} p{_p(slo, misses):g} over the SLO at {out.utilization:.0%} " \
           f"busy ({what})"


def _p(slo: Slo, misses: str) -> float:
    return slo.ttft_percentile if misses == "TTFT" else slo.tpot_percentile


def _ttft_ms(run: FleetResult, slo: Slo) -> float:
    ttfts = [t.first_token_s - t.arrival_s for t in run.turns if t.first_token_s is not None]
    return percentile(ttfts, slo.ttft_percentile) * 1000


__all__ = ["Outcome", "diagnose", "outcome"]
