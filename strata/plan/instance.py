"""One simulated instance of a plan: the real `Engine` (scheduler, paged KV, prefix cache) over
the simulated executor, on the plan's virtual clock.

The executor never sleeps: it reports how long its step takes (`last_step_s`, from the
profile), and the fleet moves the clock by it. It also moves KV in and out (`KVTransfer`) as
empty payloads, so KV offload and the prefill/decode hand-off take the engine's own import and
export paths: an imported block is a prefix hit, as on a real instance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from strata.clock import Clock
from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelInput, ModelOutput, SampledToken, ScheduledSequence
from strata.engine.outputs import EngineStats, RequestOutput
from strata.engine.request import Request
from strata.gateway.routing.instances import InstanceView
from strata.plan.workload import VOCAB_SIZE
from strata.sim.executor import SimulatedExecutor
from strata.sim.profile import LatencyProfile
from strata.types import KVPayload

PAYLOAD = b"\x00"


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine settings of every instance of a plan (`strata serve`'s defaults)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 8192
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """How a step scales over `tp` ranks (a model, not a measurement): the per-token and
    per-sequence terms split over the ranks, the fixed terms (Python, sampling) do not, and each
    step pays `allreduces_per_step` all-reduces of `allreduce_ms` (SmolLM2: 30 layers x 2; the
    shared-memory all-reduce's target on one host is 30 us)."""

    allreduces_per_step: int = 60
    allreduce_ms: float = 0.03

    def scale(self, profile: LatencyProfile, tp: int) -> LatencyProfile:
        if tp == 1:
            return profile
        comm_ms = self.allreduces_per_step * self.allreduce_ms
        return replace(profile, points=(),
                       prefill_ms_base=profile.prefill_ms_base + comm_ms,
                       prefill_ms_per_token=profile.prefill_ms_per_token / tp,
                       decode_ms_base=profile.decode_ms_base + comm_ms,
                       decode_ms_per_seq=profile.decode_ms_per_seq / tp,
                       decode_ms_per_context_token=profile.decode_ms_per_context_token / tp)


class PlanExecutor(SimulatedExecutor):
    """The simulated executor without sleeping, with empty-payload KV transfer."""

    def __init__(self, profile: LatencyProfile) -> None:
        super().__init__(profile, VOCAB_SIZE, sleep=lambda _: None)
        self.last_step_s = 0.0

    def execute(self, model_input: ModelInput) -> ModelOutput:
        before = self.busy_s
        out = super().execute(model_input)
        self.last_step_s = self.busy_s - before
        return out

    def _sample(self, seq: ScheduledSequence) -> SampledToken:
        """Cheaper than the server's digest: only a token's identity matters to a plan (for
        the prefix cache of the next turn), so any deterministic id does."""
        return SampledToken((len(seq.output_token_ids) * 7919 + len(seq.prompt_token_ids))
                            % VOCAB_SIZE)

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [PAYLOAD] * len(block_ids)

    def import_blocks(self, block_ids: list[int], payloads: list[KVPayload]) -> int:
        return len(payloads)


class _NoText:
    """A decoder with no text: the plan needs token counts, never strings."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return ""


class FleetInstance(Protocol):
    """What the fleet (fleet.py) asks of an instance: this module's `SimInstance` (the real
    engine) or a `ModelledInstance` (modelled.py: the capacity model, for hours of traffic)."""

    view: InstanceView
    started_at: float
    stopped_at: float | None

    @property
    def instance_id(self) -> str: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def busy_s(self) -> float: ...

    @property
    def num_preemptions(self) -> int: ...

    def add(self, request: Request) -> None: ...

    def advance(self, now: float) -> list[tuple[float, list[RequestOutput]]]:
        """Start what can start now; what it releases, each after how many seconds."""
        ...

    def released(self, now: float, outputs: list[RequestOutput]) -> None:
        """A release of `advance` came due (the fleet handles its outputs)."""
        ...

    def stats(self) -> EngineStats: ...


class SimInstance:
    """An engine, its executor and the gateway's view of it."""

    def __init__(self, instance_id: str, profile: LatencyProfile, shape: EngineShape,
                 clock: Clock, *, role: str = "mixed") -> None:
        self.executor = PlanExecutor(profile)
        scheduler = SchedulerConfig(max_num_seqs=shape.max_num_seqs,
                                    max_num_batched_tokens=shape.max_num_batched_tokens,
                                    max_model_len=shape.max_model_len, max_waiting=1 << 20)
        cache = CacheConfig(block_size=shape.block_size, num_blocks=shape.kv_blocks,
                            enable_prefix_caching=shape.enable_prefix_caching,
                            namespace=f"{profile.model}@plan")
        # Steps are timed in modelled seconds (the adaptive prefill budget sees the profile).
        self.engine = Engine(self.executor, cache, scheduler, _NoText(), vocab_size=VOCAB_SIZE,
                             clock=clock, step_clock=lambda: self.executor.busy_s)
        self.view = InstanceView(instance_id, f"sim://{instance_id}", profile.model, role=role)
        self.is_busy = False  # a step is under way (its end is an event)
        self.started_at = 0.0
        self.stopped_at: float | None = None

    @property
    def instance_id(self) -> str:
        return self.view.instance_id

    def add(self, request: Request) -> None:
        self.engine.add_request(request)

    def advance(self, now: float) -> list[tuple[float, list[RequestOutput]]]:
        """When idle with work, run one engine step now: [(its modelled duration in s, its
        outputs)], released when it ends; else nothing (the step under way ends first)."""
        if self.is_busy or not self.has_work:
            return []
        self.executor.last_step_s = 0.0
        outputs = self.engine.step()
        if self.executor.last_step_s <= 0 and not outputs:
            return []  # nothing could run: the next admission or finish kicks it again
        self.is_busy = True
        return [(self.executor.last_step_s, outputs)]

    def released(self, now: float, outputs: list[RequestOutput]) -> None:
        """The step under way ended."""
        self.is_busy = False

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def busy_s(self) -> float:
        return self.executor.busy_s

    @property
    def num_preemptions(self) -> int:
        return self.engine.scheduler.num_preemptions


__all__ = ["EngineShape", "FleetInstance", "PlanExecutor", "SimInstance", "TensorParallel"]
