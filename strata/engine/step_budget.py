"""The adaptive prefill budget: how many prompt tokens a step may add beside running decodes.

Every decoding stream waits for the whole step, so a 512-token prefill chunk beside 16 decodes
turns their next token's latency into several decode steps. The fixed token budget cannot know
what a token costs on this machine; `StepBudget` measures it. After each step the engine reports
its shape and wall time (`observe`). Decode-only steps give the time of a decode step (`base`);
steps with prefill tokens give the time per prefill token, (time - base) / tokens, or
time / tokens when no decode-only step was seen yet (an overestimate: a smaller chunk). While
decodes run, a step adds at most (`stretch` - 1) x base / per-token tokens of *long* prompts
(at least `floor`), so that it stays within about `stretch` decode steps. A prompt is long when
it cannot go in one step anyway (more tokens than the step's token budget): the cap decides only
how small its chunks are. Short prompts are never capped, nor counted against the cap: a burst
of them arriving together is admitted at the budget's full speed whether or not decodes run
(capping them cost the fixed load of 32 x 128-token prompts 40-52 % of its throughput, since its
first prompts decode while the rest are admitted). With no decode running, or before anything
is measured, the configured token budget alone applies.

Estimates are exponential moving averages (weight `ALPHA` for the newest step), so they follow
the context growing and the machine's load. Pure bookkeeping over numbers: no clock here (the
engine passes the elapsed seconds).
"""

from __future__ import annotations

ALPHA = 0.3
MIN_PREFILL_SAMPLE = 16  # tokens: a smaller prefill says little about the cost per token


class StepBudget:
    """`stretch` 0: no cap. Per step: `start_step`, then `limit` for each request scheduled."""

    def __init__(self, stretch: float, floor: int) -> None:
        self.stretch = stretch
        self.floor = floor
        self.base_s: float | None = None  # one decode-only step
        self.token_s: float | None = None  # one prefill token
        self.left: int | None = None  # prefill tokens this step may still add; None: no cap

    def start_step(self, num_decodes: int) -> None:
        self.left = self.prefill_cap(num_decodes) if self.stretch else None

    def limit(self, num_to_compute: int, budget: int, *, is_long: bool) -> int:
        """The token budget of a request with `num_to_compute` tokens to go; a long prompt's
        (`is_long`, more than 1 to go) is capped and counted as taken from what is left."""
        if num_to_compute <= 1 or not is_long or self.left is None:
            return budget
        budget = min(budget, self.left)
        self.left -= min(budget, num_to_compute)
        return budget

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_prefill_tokens == 0:
            if num_decodes:
                self.base_s = _ema(self.base_s, seconds)
            return
        if num_prefill_tokens < MIN_PREFILL_SAMPLE:
            return
        base = self.base_s if num_decodes and self.base_s is not None else 0.0
        per_token = max(seconds - base, 0.0) / num_prefill_tokens
        if per_token > 0.0:
            self.token_s = _ema(self.token_s, per_token)

    def prefill_cap(self, num_decodes: int) -> int | None:
        """The most prefill tokens the next step may add; None for no limit."""
        if num_decodes == 0 or self.base_s is None or self.token_s is None:
            return None
        return max(self.floor, int((self.stretch - 1.0) * self.base_s / self.token_s))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - ALPHA) * old + ALPHA * new
