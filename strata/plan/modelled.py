"""An instance as the capacity model sees it (strata/autoscale/capacity.py): no engine and no
steps, for hours of traffic on the plan's virtual clock.

The plan's own instances (instance.py) run the real engine step by step, which costs about a
minute of wall time per simulated hour at a few instances' load; the scaling law's stories and
`bench/autoscale.py` run many such hours. A modelled instance takes the place of the engine
behind the same fleet, gateway and autoscaler (fleet.py, routing.py, autoscaled.py): it runs up
to `max_num_seqs` requests at once (the rest wait in its FIFO), and a request that starts as the
b-th running one releases its first token after the prefill and one decode step of a batch of b
and finishes `latency_s(b)` after it started (the capacity model's time in system).

Two releases per request, whatever its length: an hour of 50,000 requests in a few seconds.
"""

from __future__ import annotations

from collections import deque

from strata.autoscale.capacity import CapacityModel
from strata.engine.outputs import EngineStats, RequestOutput
from strata.engine.request import FinishReason, Request
from strata.gateway.routing.instances import InstanceView

Release = tuple[float, list[RequestOutput]]  # (seconds from now, what is released then)


class ModelledInstance:
    """The fleet's instance interface (see `SimInstance`) over a capacity model."""

    def __init__(self, instance_id: str, model: CapacityModel, *, role: str = "mixed") -> None:
        self.model = model
        self.view = InstanceView(instance_id, f"sim://{instance_id}", model.profile.model,
                                 role=role)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.started_at = 0.0
        self.stopped_at: float | None = None
        self.busy_s = 0.0
        self.num_preemptions = 0  # never: a request that starts keeps its slot
        self._busy_since: float | None = None

    @property
    def instance_id(self) -> str:
        return self.view.instance_id

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def advance(self, now: float) -> list[Release]:
        """Start what fits in the free slots; each started request's two releases."""
        releases: list[Release] = []
        while self.waiting and len(self.running) < self.model.max_num_seqs:
            request = self.waiting.popleft()
            self.running[request.request_id] = request
            batch = len(self.running)
            prompt, output = request.num_prompt_tokens, request.sampling_params.max_tokens
            first_s = (self.model.prefill_ms(prompt)
                       + self.model.step_ms(batch, prompt, output)) / 1000
            releases.append((first_s, [RequestOutput(
                request.request_id, [0], "", num_prompt_tokens=prompt, num_output_tokens=1)]))
            releases.append((max(first_s, self.model.latency_s(batch, prompt, output)), [
                RequestOutput(request.request_id, [], "", finished=True,
                              finish_reason=FinishReason.LENGTH, num_prompt_tokens=prompt,
                              num_output_tokens=output)]))
        if self.running and self._busy_since is None:
            self._busy_since = now
        return releases

    def released(self, now: float, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                request = self.running.pop(output.request_id)
                request.output_token_ids = [0] * output.num_output_tokens
        if not self.running and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           num_free_blocks=0, num_total_blocks=0, kv_usage=0.0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                           num_prompt_tokens=0, num_generated_tokens=0)


__all__ = ["ModelledInstance"]
