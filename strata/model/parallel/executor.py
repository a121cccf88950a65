"""`ParallelExecutor`: the engine's `ModelExecutor` (and `KVTransfer`) over T x P ranks.

Rank 0 runs in this process, on the engine's thread; the launcher places and starts the others.
Each engine call becomes one command (commands.py), serialized once and broadcast to every rank
through shared memory, then run by rank 0 itself. The engine's interface does not change;
LoRA adapters too are commands (`add_lora`, `remove_lora`: each rank keeps its cut of them).

It is also an `AsyncModelExecutor` with P batches in flight (P = pipeline stages): `submit`
broadcasts the step and runs stage 0's share; `collect` takes the sampled tokens of the oldest
batch from the last stage. So while the last stage runs batch k, stage 0 runs batch k + 1. With
P = 1 rank 0 samples itself and a batch is done when `submit` returns.

Failure: a rank that dies makes the collectives of the others raise within ~50 ms
(`RankFailedError`, also raised by `submit`, `collect` and `execute`), and the launcher's watcher
reports it even while the instance is idle (`on_failure`, set by the server to stop the engine).
Across hosts a rank whose node is lost without a word is found by the heartbeats (liveness.py)
within ~2.5 s, with the same effects; the error names the lost rank.
Either way the executor is failed for good: the ranks no longer agree where they are, so the
instance must be restarted whole. With one pipeline stage, a rank that only could not run its
share of a step keeps the ranks in step and says so (share.py): `execute` raises
`ShareFailedError`, the executor stays healthy, and the engine isolates the request at fault.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import torch
from torch import Tensor

from strata.engine.executor import BatchHandle, ModelInput, ModelOutput
from strata.errors import ConfigError, RankFailedError, ShareFailedError
from strata.model import kernel_build
from strata.model.config import DTYPE_BYTES
from strata.model.determinism import is_deterministic
from strata.model.kv_codec import FORMAT_VERSION, KVCodec, KVLayout, KVPayloadError
from strata.model.lora import LoraAdapter, moved
from strata.model.parallel import shm
from strata.model.parallel.comm import connect, create_segments, plan_comm
from strata.model.parallel.commands import (
    AddLora,
    Allocate,
    Command,
    ExportKV,
    ImportKV,
    RankSpec,
    RemoveLora,
    Step,
    StepRows,
    Stop,
    encode,
)
from strata.model.parallel.launcher import MpRankLauncher, RankLauncher
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.pipeline import InFlight, PipelineStats, RankMemory, StepStats
from strata.model.parallel.rank import Rank
from strata.model.parallel.shard_loader import PreparedModel
from strata.model.parallel.share import ShareFault
from strata.model.parallel.weight_source import source_of
from strata.types import KVPayload

log = logging.getLogger("strata.model.parallel")
T = TypeVar("T")


class ParallelExecutor:
    """Runs one model over `layout`'s ranks (see the module docstring)."""

    def __init__(self, model: PreparedModel, layout: ParallelLayout, *, dtype: str = "bfloat16",
                 device: str = "cpu", threads: int = 1, model_name: str = "",
                 model_version: str = "default", launcher: RankLauncher | None = None,
                 timeout_s: float = 60.0, startup_timeout_s: float = 600.0,
                 faults: tuple[ShareFault, ...] = ()) -> None:
        """`faults` are for tests: ranks whose share of some steps cannot run (share.py)."""
        layout.validate(model.config)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {dtype!r} is not supported; choose one of "
                              f"{sorted(DTYPE_BYTES)}")
        self.config, self.layout, self.dtype = model.config, layout, dtype
        self.max_concurrent_batches = layout.pipeline_size
        self.on_failure: Callable[[RankFailedError], None] | None = None
        self.failure: RankFailedError | None = None
        self._failure_reported = False
        self.stats = StepStats()
        self.kv_codec: KVCodec | None = None
        self._num_slots = 0
        self._identity = (model_name, model_version)
        self._in_flight = InFlight()
        self._later_stage_busy_ns = [0] * (layout.pipeline_size - 1)
        self._wait_ns = 0  # rank 0's wait for the last stage's tokens (inside a collective)
        self.launcher: RankLauncher = launcher or MpRankLauncher()
        self.comm_spec = plan_comm(layout, self.launcher.place(layout), device=device,
                               timeout_s=timeout_s)
        if self.comm_spec.uses_torch:
            log.warning("ranks talk through torch.distributed (%s world, %s tp groups)",
                        self.comm_spec.world_backend, self.comm_spec.tp_backend)
        self._segments = create_segments(self.comm_spec)
        hosts = self.comm_spec.hosts
        source = source_of(model, dtype=dtype, host=hosts[0] if hosts else "")
        specs = [RankSpec(r, self.comm_spec, model.config, source, dtype,
                          _rank_device(device, r), threads, model_name, model_version,
                          os.getpid(), faults, kernel_build.cache_dir(), is_deterministic())
                 for r in range(layout.world_size)]
        self._start(specs, timeout_s, startup_timeout_s)
        self.launcher.watch(self._rank_exited)
        log.info("%s ranks ready: %s", layout.name,
                 ", ".join(f"rank {r.rank} pid {r.pid} {r.weight_bytes / 2**20:.0f} MiB"
                           for r in self.reports))

    def _start(self, specs: list[RankSpec], timeout_s: float, startup_timeout_s: float) -> None:
        comms = None
        try:
            self.launcher.start(specs[1:])
            comms = connect(self.comm_spec, 0, on_peer_lost=self._rank_exited)
            self.rank = Rank(specs[0], comms)
            # Ready means connected: every rank mapped its segments, which can go now.
            self.reports = [self.rank.report(), *self.launcher.wait_ready(startup_timeout_s)]
        except BaseException:
            if comms is not None:  # ranks that did start leave their wait at once
                comms.world.abort(0)
                comms.close()
            self.launcher.stop(timeout_s=2.0)
            raise
        finally:
            self._unlink_segments()

    # --- ModelExecutor and AsyncModelExecutor ---------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def kv_bytes_per_token(self) -> int:
        """The largest rank's KV bytes per token: `--kv-cache-gb` budgets each rank."""
        return max(self._rank_kv_bytes_per_token(r) for r in range(self.layout.world_size))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._run(Allocate(num_blocks, block_size))
        self._num_slots = num_blocks * block_size + 1
        c = self.config
        self.kv_codec = KVCodec(KVLayout(*self._identity, self.dtype, c.num_hidden_layers,
                                         block_size, c.num_key_value_heads, c.head_dim))

    def submit(self, model_input: ModelInput) -> BatchHandle:
        """Broadcast the step and run rank 0's share. The other ranks get only what they
        compute with, unless one of them samples (several pipeline stages)."""
        samples_here = self.layout.sampling_rank == 0
        wire = StepRows.of(model_input) if samples_here else Step(model_input)

        def run() -> ModelOutput:
            self._broadcast(wire)
            return self.rank.forward(model_input)

        output = self._guarded(run)
        return self._in_flight.submitted(output if samples_here else None)

    def collect(self, handle: BatchHandle) -> ModelOutput:
        """The tokens of `handle`, waiting for the last stage (oldest batch first)."""
        while (output := self._in_flight.take(handle)) is None:
            self._guarded(self._receive_oldest)
        return output

    def execute(self, model_input: ModelInput) -> ModelOutput:
        return self.collect(self.submit(model_input))

    # --- KVTransfer ----------------------------------------------------------------------------

    def kv_layout(self) -> dict[str, Any]:
        """What an exported block's bytes depend on: the whole model's layout, as a T=1
        instance's (so instances of any layout exchange blocks), and how the KV splits over
        these ranks (`parallel`: shown in the P/D handshake, not compared)."""
        assert self.kv_codec is not None, "invariant kv_cache_allocated"
        return {**asdict(self.kv_codec.layout), "codec_format": FORMAT_VERSION,
                "parallel": self.layout.describe(self.config)}

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Whole-model payloads (as a T=1 instance writes them), assembled from every rank."""
        self._drain()  # the slices come back on the channel the tokens take
        parts = self._run(ExportKV(block_ids))
        assert isinstance(parts, list) and self.kv_codec is not None
        whole = torch.empty((len(block_ids), *self.rank.whole_block_shape()),
                            dtype=torch.uint8)
        for rank, part in enumerate(parts):
            shard = self.layout.shard(rank, self.config)
            whole[:, shard.layers.start : shard.layers.stop, :, :,
                  shard.kv_heads.start : shard.kv_heads.stop] = part
        return [self.kv_codec.encode(block.numpy().tobytes()) for block in whole]

    def import_blocks(self, block_ids: list[int], payloads: list[KVPayload]) -> int:
        """Checks payloads here, in order, until one is refused; every rank writes its slices
        of the accepted ones (after the batches in flight: commands run in order)."""
        assert self.kv_codec is not None, "invariant kv_cache_allocated"
        bodies = []
        for payload in payloads:
            try:
                bodies.append(bytes(self.kv_codec.decode(payload)))
            except KVPayloadError as exc:
                log.warning("refused a fetched KV block (recomputed instead): %s", exc)
                break
        if bodies:
            self._run(ImportKV(block_ids[: len(bodies)], bodies))
        return len(bodies)

    # --- LoraExecutor -------------------------------------------------------------------------

    @property
    def lora_dtype(self) -> torch.dtype:
        """The dtype adapters are held in (load them in it: nothing is converted)."""
        return self.rank.executor.lora_dtype

    @property
    def lora_device(self) -> str:
        """Load adapters on the CPU: they reach the ranks pickled in a command (commands.py)."""
        return "cpu"

    def add_lora(self, adapter: LoraAdapter) -> str:
        """Every rank keeps its cut of `adapter` (the whole model's, checked by the caller),
        before any later step runs (commands run in order)."""
        if not self.has_lora(adapter.digest):
            self._run(AddLora(moved(adapter, self.lora_dtype, "cpu")))
        return adapter.digest

    def has_lora(self, digest: str) -> bool:
        return self.rank.executor.has_lora(digest)  # every rank holds what rank 0 holds

    def remove_lora(self, digest: str) -> None:
        """Every rank frees its cut, after the batches in flight that may still name it."""
        if self.has_lora(digest):
            self._run(RemoveLora(digest))

    # --- health, memory, counters, shutdown ----------------------------------------------------

    def is_alive(self) -> bool:
        return self.failure is None

    def rank_memory(self) -> list[RankMemory]:
        """Weight and KV bytes of every rank (KV: 0 before `allocate_kv_cache`)."""
        return [RankMemory(r.rank, r.host, r.pid, r.weight_bytes,
                           self._num_slots * self._rank_kv_bytes_per_token(r.rank))
                for r in self.reports]

    def comm_seconds(self) -> float:
        """Rank 0's time inside collectives so far (waiting for slower peers included; its
        wait for the last stage's tokens is not communication and is left out)."""
        groups = {id(g): g for g in (self.rank.comms.world, self.rank.comms.tp)}
        return (sum(getattr(g, "comm_ns", 0) for g in groups.values()) - self._wait_ns) / 1e9

    def pipeline_stats(self) -> PipelineStats:
        """Cumulative counters: stage busy time (stages after the first as of the last batch
        collected), active time, communication time, steps. Safe from any thread."""
        busy = [self.rank.busy_ns, *self._later_stage_busy_ns]
        return PipelineStats(tuple(b / 1e9 for b in busy), self._in_flight.active_s(),
                             self.comm_seconds(), self.stats.num_steps)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (idempotent)."""
        if self.rank.comms.liveness is not None:
            self.rank.comms.liveness.expect_end()
        if self.failure is None:
            try:
                self._broadcast(Stop())
            except RankFailedError:
                pass
        self.failure = self.failure or RankFailedError("the executor was shut down")
        self.launcher.stop(timeout_s)
        self.rank.comms.close()

    # --- plumbing ------------------------------------------------------------------------------

    def _run(self, command: Command) -> ModelOutput | list[Tensor] | None:
        """Broadcast `command`, then run it as rank 0."""

        def run() -> ModelOutput | list[Tensor] | None:
            self._broadcast(command)
            return self.rank.run(command)

        return self._guarded(run)

    def _guarded(self, call: Callable[[], T]) -> T:
        """Run a share of rank 0's work; any failure but a void step (`ShareFailedError`: the
        ranks still agree) fails the executor for good."""
        if self.failure is not None:
            raise self.failure
        try:
            with torch.inference_mode():
                return call()
        except ShareFailedError:
            raise
        except RankFailedError as exc:
            self._fail(exc)
            if self.failure is exc or self.failure is None:
                raise
            raise self.failure from exc  # the first cause: it names the lost rank
        except BaseException as exc:  # rank 0 broke off mid-command: the others wait in vain
            self._fail(RankFailedError(f"rank 0 failed mid-command: {exc!r}", rank=0))
            raise

    def _receive_oldest(self) -> None:
        world = self.rank.comms.world
        before = getattr(world, "comm_ns", 0)
        back = self.rank.receive_output()
        self._wait_ns += getattr(world, "comm_ns", 0) - before
        self._later_stage_busy_ns = back.stage_busy_ns
        self._in_flight.arrived(back.output)

    def _drain(self) -> None:
        while self._in_flight.num_pending:
            self._guarded(self._receive_oldest)

    def _broadcast(self, command: Command) -> None:
        start = time.perf_counter_ns()
        data = encode(command)
        self.stats.encode_ns += time.perf_counter_ns() - start
        self.stats.num_steps += isinstance(command, Step | StepRows)
        self.stats.num_bytes += len(data)
        self.rank.comms.world.broadcast_bytes(data, root=0)

    def _rank_exited(self, exc: RankFailedError) -> None:
        """The launcher's watcher or the heartbeats: a rank ended or was lost while the instance
        was serving (reported once)."""
        log.error("%s", exc)
        self._fail(exc)
        if self.on_failure is not None and not self._failure_reported:
            self._failure_reported = True
            self.on_failure(exc)

    def _fail(self, exc: RankFailedError) -> None:
        if self.failure is None:
            self.failure = exc
        rank = getattr(self, "rank", None)  # None while rank 0 still starts
        if rank is not None:
            for group in (rank.comms.world, rank.comms.tp):
                group.abort(max(exc.rank, 0))

    def _rank_kv_bytes_per_token(self, rank: int) -> int:
        shard = self.layout.shard(rank, self.config)
        return (2 * len(shard.kv_heads) * self.config.head_dim * DTYPE_BYTES[self.dtype]
                * len(shard.layers))

    def _unlink_segments(self) -> None:
        for name in self._segments:
            shm.ShmGroup.unlink(name)


def _rank_device(device: str, rank: int) -> str:
    """Ranks of a CUDA instance take one GPU each ("cuda" means all of this host's, in turn)."""
    if device != "cuda":
        return device
    return f"cuda:{rank % max(torch.cuda.device_count(), 1)}"


__all__ = ["ParallelExecutor", "RankMemory", "StepStats"]
