"""Batches in flight through the pipeline stages, as rank 0 keeps them, and what the stages did.

With P stages the engine keeps up to P batches in flight (`AsyncModelExecutor`): rank 0 submits
batch k + 1 (broadcast, then stage 0's share) while later stages still run batch k, and collects
the tokens of the oldest batch from the sampling rank. `InFlight` numbers the batches, keeps
the outputs that came back before the engine asked for them (a KV export drains the pipeline
first: its slices share the channel the tokens come back on) and measures the time during which
some batch was in flight. `PipelineStats` are the cumulative counters behind the stage busy
fractions and the communication time per step on /metrics; `RankMemory` and `StepStats` the
other numbers an instance reports about its ranks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from strata.engine.executor import BatchHandle, ModelOutput


@dataclass(frozen=True, slots=True)
class RankMemory:
    rank: int
    host: str
    pid: int
    weight_bytes: int
    kv_bytes: int


@dataclass(slots=True)
class StepStats:
    """What broadcasting the steps cost rank 0 (bench/parallel.py reads it)."""

    num_steps: int = 0
    num_bytes: int = 0
    encode_ns: int = 0


@dataclass(frozen=True, slots=True)
class PipelineStats:
    """Cumulative counters of a parallel instance since it started."""

    stage_busy_s: tuple[float, ...]  # per stage: time computing its share of the steps
    active_s: float  # wall time during which at least one batch was in flight
    comm_s: float  # rank 0's time inside collectives (not its wait for the last stage)
    num_steps: int

    def busy_fractions(self, before: PipelineStats) -> tuple[float, ...]:
        """Each stage's busy time / active time between `before` and now (0 when idle)."""
        active = self.active_s - before.active_s
        if active <= 0:
            return tuple(0.0 for _ in self.stage_busy_s)
        return tuple(min(1.0, max(0.0, (now - then) / active))
                     for now, then in zip(self.stage_busy_s, before.stage_busy_s, strict=True))

    def comm_s_per_step(self, before: PipelineStats) -> float:
        steps = self.num_steps - before.num_steps
        return (self.comm_s - before.comm_s) / steps if steps > 0 else 0.0


class InFlight:
    """Handles of the submitted batches, oldest first, and the outputs already back."""

    def __init__(self, clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock_ns = clock_ns
        self._next = 0
        self._pending: deque[BatchHandle] = deque()  # their tokens come from the sampling rank
        self._back: dict[BatchHandle, ModelOutput] = {}
        self._active_since: int | None = None
        self._active_ns = 0
        self.max_len = 0  # the most batches in flight at once so far

    def __len__(self) -> int:
        return len(self._pending) + len(self._back)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submitted(self, output: ModelOutput | None) -> BatchHandle:
        """A new batch; `output` when it is already known (rank 0 samples), else None."""
        handle = BatchHandle(self._next)
        self._next += 1
        if not len(self):
            self._active_since = self._clock_ns()
        if output is None:
            self._pending.append(handle)
        else:
            self._back[handle] = output
        self.max_len = max(self.max_len, len(self))
        return handle

    def arrived(self, output: ModelOutput) -> None:
        """The output of the oldest pending batch came back."""
        self._back[self._pending.popleft()] = output

    def take(self, handle: BatchHandle) -> ModelOutput | None:
        """The batch's output once back (it leaves); None while it is still pending."""
        if handle in self._back:
            output = self._back.pop(handle)
            if not len(self) and self._active_since is not None:
                self._active_ns += self._clock_ns() - self._active_since
                self._active_since = None
            return output
        if handle not in self._pending:
            raise RuntimeError(f"invariant collect_once: batch {handle} was not submitted or "
                               "was already collected")
        return None

    def active_s(self) -> float:
        running = self._clock_ns() - self._active_since if self._active_since is not None else 0
        return (self._active_ns + running) / 1e9
