"""One rank of a parallel instance: its shard as a `TorchExecutor`, and its side of each command
(commands.py).

A Step on a worker: run its share of the forward (`forward`; a later stage first receives the
hidden states of the stage before it), then tp rank 0 of each later stage hands the stages' busy
times on, and the sampling rank sends them to rank 0 with the sampled tokens (`StageOutput`).
Rank 0 runs its share with `forward` and receives the tokens with `receive_output`, later, so
that it can submit the next batch first (pipeline parallel).

With one pipeline stage (tensor parallel), a share that raises does not end the rank: it makes
the collectives it still owes and reports the failure to rank 0, which voids the step
(share.py); every rank reports after every step. With several stages a share that raises ends
the rank's process, and the instance restarts.

KV blocks cross the instance's boundary in the whole model's layout (kv_codec's body: layers x
K/V x slots x KV heads x head_dim), so a block exported by a T=2 instance imports into a T=1 one.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time

import torch
from torch import Tensor

from strata.engine.executor import ModelInput, ModelOutput
from strata.errors import RankFailedError, ShareFailedError
from strata.model.attention import PagedKVCache
from strata.model.config import ModelConfig
from strata.model.executor import TorchExecutor
from strata.model.gemm import PackedWeight
from strata.model.parallel.comm import RankComms
from strata.model.parallel.commands import (
    AddLora,
    Allocate,
    Command,
    ExportKV,
    ImportKV,
    RankReport,
    RankSpec,
    RemoveLora,
    StageOutput,
    Step,
    StepRows,
    encode,
)
from strata.model.parallel.layout import ParallelLayout, even_split
from strata.model.parallel.shard_loader import load_shard
from strata.model.parallel.share import CallCount, ShareFault, placeholder_batch, report_shares
from strata.model.parallel.weight_source import resolve_on_node
from strata.model.shard import RankShard

log = logging.getLogger("strata.model.parallel")


class RankShardComm:
    """The `ShardComm` hooks of a rank, over its two groups. Each collective is counted
    (`calls`), so that a replay makes only those a failed share still owes (share.py)."""

    def __init__(self, comms: RankComms, layout: ParallelLayout, rank: int,
                 config: ModelConfig) -> None:
        coords = layout.coords(rank)
        self.comms = comms
        self.is_split = layout.tensor_size > 1
        self.vocab_widths = [len(r) for r in even_split(config.vocab_size, layout.tensor_size)]
        self.prev = layout.rank_of(coords.stage - 1, coords.tp_rank) if coords.stage else -1
        self.next = layout.rank_of(coords.stage + 1, coords.tp_rank)
        self.wait_ns = 0  # in recv_hidden / send_hidden: the stage waits, it is not busy
        self.calls = CallCount()
        self.fault: ShareFault | None = None  # armed for this share (tests)

    def all_reduce(self, x: Tensor) -> Tensor:
        if not self.is_split or self._skips():
            return x
        out = self.comms.tp.all_reduce(x)
        self.calls.num_made += 1
        return out

    def gather_vocab(self, logits: Tensor) -> Tensor | None:
        if not self.is_split:
            return logits
        if self._skips():
            return None
        out = self.comms.tp.gather(logits, self.vocab_widths, root=0)
        self.calls.num_made += 1
        return out

    def recv_hidden(self, like: Tensor) -> Tensor:
        if self._skips():
            return like
        start = time.perf_counter_ns()
        try:
            out = self.comms.world.recv(like, self.prev)
        finally:
            self.wait_ns += time.perf_counter_ns() - start
        self.calls.num_made += 1
        return out

    def send_hidden(self, x: Tensor) -> None:
        if self._skips():
            return
        start = time.perf_counter_ns()
        try:
            self.comms.world.send(x, self.next)
        finally:
            self.wait_ns += time.perf_counter_ns() - start
        self.calls.num_made += 1

    def _skips(self) -> bool:
        skips = self.calls.skips()
        if self.fault is not None and self.calls.num_calls == self.fault.at_call:
            self.fault.trip(f"collective {self.calls.num_calls}")
        return skips


class Rank:
    """A rank's shard of the model and its side of every command."""

    def __init__(self, spec: RankSpec, comms: RankComms) -> None:
        self.spec = spec
        self.comms = comms
        self.shard: RankShard = spec.layout.shard(spec.rank, spec.config)
        self.coords = spec.layout.coords(spec.rank)
        host = spec.comm.hosts[spec.rank] if spec.comm.hosts else ""
        files = resolve_on_node(spec.weights, host)
        weights = load_shard(files, spec.config, self.shard, spec.dtype)
        self.comm = RankShardComm(comms, spec.layout, spec.rank, spec.config)
        self.executor = TorchExecutor(
            spec.config, weights, dtype=spec.dtype, device=spec.device,
            model_name=spec.model_name, model_version=spec.model_version, shard=self.shard,
            comm=self.comm)
        weights.clear()
        self.weight_bytes = _weight_bytes(self.executor)
        self.busy_ns = 0  # time in `forward`, less the waits for the stages around
        self.isolates = spec.layout.pipeline_size == 1  # a failed share is not the end
        self._scratch: PagedKVCache | None = None  # what a replay writes to

    def report(self) -> RankReport:
        return RankReport(self.spec.rank, os.getpid(), socket.gethostname(), self.weight_bytes)

    def run(self, command: Command) -> ModelOutput | list[Tensor] | None:
        """This rank's side of `command`; rank 0 gets what the command returns (rank 0 runs a
        Step of several stages as `forward`, then `receive_output`)."""
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
        elif isinstance(command, AddLora):
            self.executor.add_lora(command.adapter)  # keeps this shard's cut
        elif isinstance(command, RemoveLora):
            self.executor.remove_lora(command.digest)
        return None

    def forward(self, model_input: ModelInput) -> ModelOutput:
        """This rank's share of a step: the sampled tokens on the sampling rank, {} elsewhere.
        The stage is busy from start to end, less its waits for the stages around it."""
        waited = self.comm.wait_ns
        start = time.perf_counter_ns()
        try:
            if self.isolates:
                return self._isolated_share(model_input)
            return self.executor.execute(model_input)
        finally:
            self.busy_ns += time.perf_counter_ns() - start - (self.comm.wait_ns - waited)

    def _isolated_share(self, model_input: ModelInput) -> ModelOutput:
        """The share of a one-stage step, whose failure is the step's, not the rank's
        (share.py); rank 0 raises ShareFailedError when any rank's share failed."""
        self.comm.fault = next((f for f in self.spec.faults
                                if f.is_armed(self.spec.rank, model_input)), None)
        self.comm.calls.begin_share()
        failure: Exception | None = None
        output: ModelOutput = {}
        try:
            if self.comm.fault is not None and self.comm.fault.at_call == 0:
                self.comm.fault.trip("before the forward")
            output = self.executor.execute(model_input)
        except RankFailedError:
            raise
        except Exception as exc:
            failure = exc
            log.error("rank %d could not run its share of a step of %d sequences: %r",
                      self.spec.rank, len(model_input.sequences), exc)
            self._replay(model_input)
        failed = report_shares(self.comms.tp, failure is not None)
        if failed:
            raise ShareFailedError(
                f"rank(s) {failed} could not run their share of the step"
                + (f": {failure!r}" if failure is not None else " (their logs say why)"),
                ranks=tuple(failed)) from failure
        return output

    def _replay(self, model_input: ModelInput) -> None:
        """Make the collectives the failed share still owes, over a placeholder of the step's
        shape; a replay that fails too leaves the rank unable to go on (it raises)."""
        fault, self.comm.fault = self.comm.fault, None
        self.comm.calls.begin_replay()
        if fault is not None and fault.is_fatal:
            fault.trip("its replay")
        if self._scratch is None:
            self._scratch = PagedKVCache(
                self.spec.config, 1, 1, self.executor.model.dtype, self.spec.device,
                num_layers=len(self.shard.layers), kv_heads=len(self.shard.kv_heads))
        with torch.inference_mode():
            self.executor.model.forward(placeholder_batch(model_input, self.spec.device),
                                        self._scratch)

    def receive_output(self) -> StageOutput:
        """Rank 0: the next Step's tokens from the sampling rank (the oldest batch in flight)."""
        data = self.comms.world.recv_bytes(self.spec.layout.sampling_rank)
        output = pickle.loads(data)  # noqa: S301 -- bytes from a rank of this instance only
        assert isinstance(output, StageOutput)
        return output

    def _step(self, model_input: ModelInput) -> ModelOutput | None:
        output = self.forward(model_input)
        if self.spec.rank == 0:
            return output
        self._hand_on(output)
        return None

    def _hand_on(self, output: ModelOutput) -> None:
        """tp rank 0 of each stage after the first passes the stages' busy times on: to the
        next stage, or with the tokens to rank 0 (the sampling rank)."""
        stage, layout, world = self.coords.stage, self.spec.layout, self.comms.world
        if stage == 0 or self.coords.tp_rank != 0:
            return
        busy: list[int] = []
        if stage > 1:
            busy = pickle.loads(world.recv_bytes(layout.rank_of(stage - 1, 0)))  # noqa: S301
        busy.append(self.busy_ns)
        if self.spec.rank == layout.sampling_rank:
            world.send_bytes(encode(StageOutput(output, busy)), 0)
        else:
            world.send_bytes(encode(busy), layout.rank_of(stage + 1, 0))

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
