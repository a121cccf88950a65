"""What travels between the ranks of a parallel instance: how a rank starts, the commands rank 0
broadcasts, and what the sampling rank sends back.

Rank 0 (in the serving process) broadcasts each command once, pickled once, to every rank, then
runs it itself; every other rank runs it as it arrives (worker.py). So all ranks run the same
commands in the same order, which is what keeps their collectives matched:

    Allocate(num_blocks, block_size)   every rank allocates the KV of its heads and layers
    Step(model_input)                  every rank runs its share of the forward; the sampling
                                       rank samples and, when it is not rank 0, sends the
                                       tokens to rank 0 (a `StageOutput`)
    StepRows(block_size, rows)         a Step for ranks that do not sample: per sequence only
                                       (tokens, start, blocks, needs_sample), 10x cheaper to
                                       encode than the whole ModelInput (sent when rank 0
                                       samples, i.e. one pipeline stage)
    ExportKV(block_ids)                every rank sends its slices of the blocks to rank 0
    ImportKV(block_ids, bodies)        every rank writes its slices of whole-model blocks
    AddLora(adapter)                   every rank keeps its cut of a whole LoRA adapter, which
                                       rank 0 read and checked (strata.model.lora.sharded)
    RemoveLora(digest)                 every rank frees its cut of the adapter
    Stop()                             workers leave their loop

With several pipeline stages rank 0 does not wait for a Step's tokens before it broadcasts the
next one (up to P batches in flight); every rank still runs the commands in broadcast order.
So an adapter is added on every rank before the first step that names it, and freed only after
the last one (the engine frees it once no request in flight names it).

Adapters travel as tensors in the command, as KV bodies do, not as a path each rank reads (as
the weights are): an adapter is megabytes where the weights are gigabytes, rank 0 already holds
it whole (it read and checked it to answer the load by name), and a rank on another node then
needs no copy of the files, nor can it read other files than rank 0's under the same digest.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

from strata.engine.executor import ModelInput, ModelOutput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.model.config import ModelConfig
from strata.model.lora import LoraAdapter
from strata.model.parallel.comm import CommSpec
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.share import ShareFault
from strata.model.parallel.weight_source import WeightSource
from strata.types import RequestId


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank process needs to start (picklable)."""

    rank: int
    comm: CommSpec
    config: ModelConfig
    weights: WeightSource  # resolved on the rank's node
    dtype: str
    device: str
    threads: int
    model_name: str
    model_version: str
    parent_pid: int
    faults: tuple[ShareFault, ...] = ()  # tests only: shares that cannot run (share.py)
    kernel_cache_dir: Path | None = None  # rank 0's kernel cache (kernel_build.use_cache_dir)
    deterministic: bool = False  # rank 0's determinism switch (`--deterministic`)

    @property
    def layout(self) -> ParallelLayout:
        return self.comm.layout


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a rank tells rank 0 once it is ready."""

    rank: int
    pid: int
    host: str
    weight_bytes: int


@dataclass(frozen=True, slots=True)
class Allocate:
    num_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class Step:
    model_input: ModelInput


@dataclass(frozen=True, slots=True)
class StepRows:
    block_size: int
    rows: list[tuple[list[int], int, list[int], bool, str]]  # ..., needs_sample, lora_digest

    @staticmethod
    def of(model_input: ModelInput) -> StepRows:
        return StepRows(model_input.block_size,
                        [(s.token_ids, s.start_pos, s.block_ids, s.needs_sample, s.lora_digest)
                         for s in model_input.sequences])

    def model_input(self) -> ModelInput:
        """The step as `TorchExecutor.execute` takes it, without what only sampling reads."""
        return ModelInput([ScheduledSequence(_NO_ID, tokens, start, blocks, needs, _NO_PARAMS,
                                             [], [], lora_digest=lora)
                           for tokens, start, blocks, needs, lora in self.rows],
                          self.block_size)


_NO_ID = RequestId("")
_NO_PARAMS = SamplingParams()


@dataclass(frozen=True, slots=True)
class ExportKV:
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class ImportKV:
    block_ids: list[int]
    bodies: list[bytes]  # whole-model block bodies, already checked by rank 0


@dataclass(frozen=True, slots=True)
class AddLora:
    adapter: LoraAdapter  # the whole model's, on the CPU


@dataclass(frozen=True, slots=True)
class RemoveLora:
    digest: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Allocate | Step | StepRows | ExportKV | ImportKV | AddLora | RemoveLora | Stop


@dataclass(frozen=True, slots=True)
class StageOutput:
    """What the sampling rank (not rank 0) sends rank 0 after each Step: the sampled tokens and
    the busy time so far of every stage after the first (stages 1 .. P-1, nanoseconds), which
    travels with the step from stage to stage."""

    output: ModelOutput
    stage_busy_ns: list[int]


def encode(command: Command | StageOutput | list[int]) -> bytes:
    return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Command:
    command = pickle.loads(data)  # noqa: S301 -- bytes from rank 0 of this instance only
    assert isinstance(command, Allocate | Step | StepRows | ExportKV | ImportKV | AddLora
                      | RemoveLora | Stop)
    return command
