"""One rank of a parallel instance: its shard as a `TorchExecutor`, and the commands it runs.

Rank 0 (in the serving process) broadcasts each command once, pickled once, to every rank, then
runs it itself; every other rank runs it as it arrives (worker.py). So all ranks run the same
commands in the same order, which is what keeps their collectives matched:

    Allocate(num_blocks, block_size)   every rank allocates the KV of its heads and layers
    Step(model_input)                  every rank runs its share of the forward; the sampling
                                       rank samples and, when it is not rank 0, sends the
                                       tokens to rank 0
    StepRows(block_size, rows)         a Step for ranks that do not sample: per sequence only
                                       (tokens, start, blocks, needs_sample), 10x cheaper to
                                       encode than the whole ModelInput (sent when rank 0
                                       samples, i.e. one pipeline stage)
    ExportKV(block_ids)                every rank sends its slices of the blocks to rank 0
    ImportKV(block_ids, bodies)        every rank writes its slices of whole-model blocks
    Stop()                             workers leave their loop

KV blocks cross the instance's boundary in the whole model's layout (kv_codec's body: layers x
K/V x slots x KV heads x head_dim), so a block exported by a T=2 instance imports into a T=1 one.
"""

from __future__ import annotations

import os
import pickle
import socket
from dataclasses import dataclass

import torch
from torch import Tensor

from strata.engine.executor import ModelInput, ModelOutput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.model.config import ModelConfig
from strata.model.executor import TorchExecutor
from strata.model.gemm import PackedWeight
from strata.model.parallel.comm import CommSpec, RankComms
from strata.model.parallel.layout import ParallelLayout, even_split
from strata.model.parallel.shard_loader import WeightFiles, load_shard
from strata.model.shard import RankShard
from strata.types import RequestId


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank process needs to start (picklable)."""

    rank: int
    comm: CommSpec
    config: ModelConfig
    weights: WeightFiles
    dtype: str
    device: str
    threads: int
    model_name: str
    model_version: str
    parent_pid: int

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
    rows: list[tuple[list[int], int, list[int], bool]]

    @staticmethod
    def of(model_input: ModelInput) -> StepRows:
        return StepRows(model_input.block_size,
                        [(s.token_ids, s.start_pos, s.block_ids, s.needs_sample)
                         for s in model_input.sequences])

    def model_input(self) -> ModelInput:
        """The step as `TorchExecutor.execute` takes it, without what only sampling reads."""
        return ModelInput([ScheduledSequence(_NO_ID, tokens, start, blocks, needs, _NO_PARAMS,
                                             [], [])
                           for tokens, start, blocks, needs in self.rows], self.block_size)


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
class Stop:
    pass


Command = Allocate | Step | StepRows | ExportKV | ImportKV | Stop


def encode(command: Command) -> bytes:
    return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Command:
    command = pickle.loads(data)  # noqa: S301 -- bytes from rank 0 of this instance only
    assert isinstance(command, Allocate | Step | StepRows | ExportKV | ImportKV | Stop)
    return command


class RankShardComm:
    """The `ShardComm` hooks of a rank, over its two groups."""

    def __init__(self, comms: RankComms, layout: ParallelLayout, rank: int,
                 config: ModelConfig) -> None:
        coords = layout.coords(rank)
        self.comms = comms
        self.is_split = layout.tensor_size > 1
        self.vocab_widths = [len(r) for r in even_split(config.vocab_size, layout.tensor_size)]
        self.prev = layout.rank_of(coords.stage - 1, coords.tp_rank) if coords.stage else -1
        self.next = layout.rank_of(coords.stage + 1, coords.tp_rank)

    def all_reduce(self, x: Tensor) -> Tensor:
        return self.comms.tp.all_reduce(x) if self.is_split else x

    def gather_vocab(self, logits: Tensor) -> Tensor | None:
        if not self.is_split:
            return logits
        return self.comms.tp.gather(logits, self.vocab_widths, root=0)

    def recv_hidden(self, like: Tensor) -> Tensor:
        return self.comms.world.recv(like, self.prev)

    def send_hidden(self, x: Tensor) -> None:
        self.comms.world.send(x, self.next)


class Rank:
    """A rank's shard of the model and its side of every command."""

    def __init__(self, spec: RankSpec, comms: RankComms) -> None:
        self.spec = spec
        self.comms = comms
        self.shard: RankShard = spec.layout.shard(spec.rank, spec.config)
        weights = load_shard(spec.weights, spec.config, self.shard, spec.dtype)
        self.executor = TorchExecutor(
            spec.config, weights, dtype=spec.dtype, device=spec.device,
            model_name=spec.model_name, model_version=spec.model_version, shard=self.shard,
            comm=RankShardComm(comms, spec.layout, spec.rank, spec.config))
        weights.clear()
        self.weight_bytes = _weight_bytes(self.executor)

    def report(self) -> RankReport:
        return RankReport(self.spec.rank, os.getpid(), socket.gethostname(), self.weight_bytes)

    def run(self, command: Command) -> ModelOutput | list[Tensor] | None:
        """This rank's side of `command`; rank 0 gets what the command returns."""
        if isinstance(command, Step):
            return self._step(command.model_input)
        if isinstance(command, StepRows):
            return self._step(command.model_input())
        if isinstance(command, Allocate):
            self.executor.allocate_kv_cache(command.num_blocks, command.block_size)
        elif isinstance(command, ExportKV):
            return self._export(command.block_ids)
        elif isinstance(command, ImportKV):
            self._import(command.block_ids, command.bodies)
        return None

    def _step(self, model_input: ModelInput) -> ModelOutput | None:
        output = self.executor.execute(model_input)
        sampler, rank = self.spec.layout.sampling_rank, self.spec.rank
        if rank == sampler == 0:
            return output
        if rank == sampler:
            self.comms.world.send_bytes(pickle.dumps(output, pickle.HIGHEST_PROTOCOL), 0)
        elif rank == 0:
            return dict(pickle.loads(self.comms.world.recv_bytes(sampler)))  # noqa: S301
        return None

    def _export(self, block_ids: list[int]) -> list[Tensor] | None:
        """Each rank's blocks (blocks, layers, 2, slots, kv heads, bytes per head); rank 0
        returns every rank's, in rank order."""
        mine = self.block_bytes(block_ids)
        if self.spec.rank != 0:
            self.comms.world.send(mine, 0)
            return None
        parts = [mine]
        for rank in range(1, self.spec.layout.world_size):
            shard = self.spec.layout.shard(rank, self.spec.config)
            parts.append(self.comms.world.recv(
                torch.empty(self._block_shape(shard, len(block_ids)), dtype=torch.uint8), rank))
        return parts

    def _import(self, block_ids: list[int], bodies: list[bytes]) -> None:
        cache = self.executor.kv_cache
        assert cache is not None, "invariant kv_cache_allocated"
        layers, heads = self.shard.layers, self.shard.kv_heads
        for block_id, body in zip(block_ids, bodies, strict=True):
            whole = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(
                self.whole_block_shape())
            start = block_id * cache.block_size
            dest = cache.data.view(torch.uint8)[:, :, start : start + cache.block_size]
            dest.copy_(whole[layers.start : layers.stop, :, :, heads.start : heads.stop])

    def block_bytes(self, block_ids: list[int]) -> Tensor:
        cache = self.executor.kv_cache
        assert cache is not None, "invariant kv_cache_allocated"
        bs = cache.block_size
        raw = cache.data.view(torch.uint8)
        if not block_ids:
            return torch.empty(self._block_shape(self.shard, 0), dtype=torch.uint8)
        return torch.stack([raw[:, :, b * bs : (b + 1) * bs] for b in block_ids]).contiguous()

    def _block_shape(self, shard: RankShard, num_blocks: int) -> tuple[int, ...]:
        _, _, bs, _, row = self.whole_block_shape()
        return (num_blocks, len(shard.layers), 2, bs, len(shard.kv_heads), row)

    def whole_block_shape(self) -> tuple[int, int, int, int, int]:
        cache = self.executor.kv_cache
        assert cache is not None, "invariant kv_cache_allocated"
        c = self.spec.config
        item = cache.data.element_size()
        return (c.num_hidden_layers, 2, cache.block_size, c.num_key_value_heads,
                c.head_dim * item)


def _weight_bytes(executor: TorchExecutor) -> int:
    """Bytes of every weight tensor the shard's model holds (one tensor in two roles, e.g. a
    tied float32 embedding and LM head, counted once)."""
    model = executor.model
    tensors = [model.embed, model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.post_norm,
                    layer.gate_up, layer.down]
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, PackedWeight):
            seen[id(t)] = t.nbytes  # bf16 on a CPU without AMX: both of its layouts
        elif t is not None:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
