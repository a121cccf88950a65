"""The batches the engine has submitted to its executor and not yet collected.

A plain `ModelExecutor` runs one batch at a time: `submit` runs it at once and the queue holds one
batch, so a step is schedule -> execute -> update. Its failures are isolated (isolation.py): a
request whose sequence fails alone is named in `Collected.failed`. So are those of an
`AsyncModelExecutor` that keeps one batch in flight (tensor parallel: its `execute`). One with
more (pipeline parallel) takes up to `max_concurrent_batches`; `collect_oldest` blocks on the
oldest, the order in which the executor finishes them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from strata.engine.executor import (
    AsyncModelExecutor,
    BatchHandle,
    ModelExecutor,
    ModelInput,
    ModelOutput,
)
from strata.engine.isolation import IsolatedOutput, IsolatingRunner
from strata.engine.scheduler import SchedulerOutput
from strata.errors import ConfigError
from strata.types import RequestId


@dataclass(slots=True)
class Collected:
    """A batch back from the executor: what was scheduled, the sampled tokens, and the requests
    whose sequence failed alone (with why)."""

    scheduled: SchedulerOutput
    output: ModelOutput
    failed: dict[RequestId, Exception] = field(default_factory=dict)


class _RunAtOnce:
    """A plain `ModelExecutor` seen as an executor of one batch in flight, its failures
    isolated."""

    max_concurrent_batches = 1

    def __init__(self, executor: ModelExecutor) -> None:
        self.runner = IsolatingRunner(executor)
        self._result: IsolatedOutput | None = None

    def submit(self, model_input: ModelInput) -> BatchHandle:
        self._result = self.runner.run(model_input)
        return BatchHandle(0)

    def collect(self, handle: BatchHandle) -> ModelOutput:
        return self.take().output

    def take(self) -> IsolatedOutput:
        result, self._result = self._result, None
        if result is None:
            raise RuntimeError("collect_after_submit: no batch was submitted")
        return result


class BatchQueue:
    def __init__(self, executor: ModelExecutor) -> None:
        self._executor: AsyncModelExecutor
        if isinstance(executor, AsyncModelExecutor) and executor.max_concurrent_batches != 1:
            self._executor = executor
        else:
            self._executor = _RunAtOnce(executor)
        self.max_batches = self._executor.max_concurrent_batches
        if self.max_batches < 1:
            raise ConfigError(f"max_concurrent_batches must be >= 1, got {self.max_batches}")
        self._batches: deque[tuple[SchedulerOutput, BatchHandle]] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def has_room(self) -> bool:
        return len(self._batches) < self.max_batches

    def submit(self, scheduled: SchedulerOutput, model_input: ModelInput) -> None:
        self._batches.append((scheduled, self._executor.submit(model_input)))

    def collect_oldest(self) -> Collected | None:
        """Wait for the oldest batch in flight; None when there is none."""
        if not self._batches:
            return None
        scheduled, handle = self._batches.popleft()
        if isinstance(self._executor, _RunAtOnce):
            result = self._executor.take()
            return Collected(scheduled, result.output, result.failed)
        return Collected(scheduled, self._executor.collect(handle))

    def in_flight(self) -> Iterator[SchedulerOutput]:
        return (scheduled for scheduled, _ in self._batches)
