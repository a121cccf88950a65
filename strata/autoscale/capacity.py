"""What one instance can serve, from its fitted latency profile (strata/sim/profile.py).

An instance decodes a batch of B requests in one step of `step_ms(0, B, context)`; the largest
B whose step stays within the ITL target is the batch it can run without breaking the SLO (at
most its running-slot cap). A request then costs its prefill plus its share of its decode steps:

    service_ms = prefill_ms(P) + O * step_ms(B) / B        requests/s = 1000 / service_ms

and, when b requests share an instance, stays in it for `O * step_ms(b) + b * prefill_ms(P)`:
its decode steps, plus the prefills of the b requests that replace the finishing ones meanwhile
(so b / that = requests/s at batch b). That is Little's law's time in system: the requests in
flight the model predicts, which the autoscaler compares with what it measures.

A pool of one role (Stage 6a's P/D) does one half of that work:

    prefill   service_ms = prefill_ms(P): one prompt after another; b in flight stay b of them
    decode    service_ms = O * step_ms(B) / B: its decode steps only (the prompt's KV arrives)
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError
from strata.sim.profile import LatencyProfile

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class CapacityModel:
    profile: LatencyProfile
    max_num_seqs: int
    itl_slo_s: float
    role: str = "mixed"  # what the instances do: both halves, or prefill or decode only

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"a capacity model's role is one of {ROLES}, got {self.role!r}")

    def step_ms(self, batch: float, prompt_tokens: float, output_tokens: float) -> float:
        batch = max(1.0, batch)
        context = batch * (prompt_tokens + output_tokens / 2)
        return self.profile.step_ms(0, max(1, round(batch)), round(context))

    def prefill_ms(self, prompt_tokens: float) -> float:
        return self.profile.step_ms(max(1, round(prompt_tokens)), 0)

    def batch_for_itl(self, prompt_tokens: float, output_tokens: float) -> int:
        """The largest batch whose decode step stays within the ITL target (at least 1)."""
        best = 1
        for batch in range(1, self.max_num_seqs + 1):
            if self.step_ms(batch, prompt_tokens, output_tokens) <= self.itl_slo_s * 1000:
                best = batch
        return best

    def requests_per_s(self, prompt_tokens: float, output_tokens: float) -> float:
        """Requests one instance completes per second at its SLO batch."""
        batch = self.batch_for_itl(prompt_tokens, output_tokens)
        prefill_ms = self.prefill_ms(prompt_tokens) if self.role != "decode" else 0.0
        decode_ms = output_tokens * self.step_ms(batch, prompt_tokens, output_tokens) / batch \
            if self.role != "prefill" else 0.0
        return 1000.0 / (prefill_ms + decode_ms)

    def latency_s(self, batch: float, prompt_tokens: float, output_tokens: float) -> float:
        """How long a request stays in an instance that runs `batch` requests at once."""
        prefill_ms = max(1.0, batch) * self.prefill_ms(prompt_tokens) \
            if self.role != "decode" else 0.0
        decode_ms = output_tokens * self.step_ms(batch, prompt_tokens, output_tokens) \
            if self.role != "prefill" else 0.0
        return (prefill_ms + decode_ms) / 1000.0

    def itl_s(self, batch: float, prompt_tokens: float, output_tokens: float) -> float:
        """The inter-token latency of a decode batch of `batch` (the profile's step)."""
        return self.step_ms(batch, prompt_tokens, output_tokens) / 1000.0


__all__ = ["CapacityModel"]
