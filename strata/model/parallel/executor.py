"""`ParallelExecutor`: the engine's `ModelExecutor` (and `KVTransfer`) over T x P ranks.

Rank 0 runs in this process, on the engine's thread; the launcher starts the others. Each
engine call becomes one command (rank.py), serialized once and broadcast to every rank through
shared memory, then run by rank 0 itself. The engine's interface does not change.

Failure: a rank that dies makes the collectives of the others raise within ~50 ms
(`RankFailedError`, also raised by `execute`), and the launcher's watcher reports it even while
the instance is idle (`on_failure`, set by the server to stop the engine). Either way the
executor is failed for good: the ranks no longer agree where they are, so the instance must be
restarted whole.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from strata.engine.executor import ModelInput, ModelOutput
from strata.errors import ConfigError, RankFailedError
from strata.model.config import DTYPE_BYTES
from strata.model.kv_codec import KVCodec, KVLayout, KVPayloadError
from strata.model.parallel import shm
from strata.model.parallel.comm import CommSpec, connect, create_segments
from strata.model.parallel.launcher import MpRankLauncher, RankLauncher
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.rank import (
    Allocate,
    Command,
    ExportKV,
    ImportKV,
    Rank,
    RankSpec,
    Step,
    StepRows,
    Stop,
    encode,
)
from strata.model.parallel.shard_loader import PreparedModel

log = logging.getLogger("strata.model.parallel")


@dataclass(frozen=True, slots=True)
class RankMemory:
    rank: int
    pid: int
    weight_bytes: int
    kv_bytes: int


@dataclass(slots=True)
class StepStats:
    """What broadcasting the steps cost rank 0 (bench/parallel.py reads it)."""

    num_steps: int = 0
    num_bytes: int = 0
    encode_ns: int = 0


class ParallelExecutor:
    """Runs one model over `layout`'s ranks (see the module docstring)."""

    def __init__(self, model: PreparedModel, layout: ParallelLayout, *, dtype: str = "bfloat16",
                 device: str = "cpu", threads: int = 1, model_name: str = "",
                 model_version: str = "default", launcher: RankLauncher | None = None,
                 timeout_s: float = 60.0, startup_timeout_s: float = 600.0) -> None:
        layout.validate(model.config)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {dtype!r} is not supported; choose one of "
                              f"{sorted(DTYPE_BYTES)}")
        self.config, self.layout, self.dtype = model.config, layout, dtype
        self.on_failure: Callable[[RankFailedError], None] | None = None
        self.failure: RankFailedError | None = None
        self.stats = StepStats()
        self.kv_codec: KVCodec | None = None
        self._num_slots = 0
        self._identity = (model_name, model_version)
        self._comm = _comm_spec(layout, device, timeout_s)
        self._segments = create_segments(self._comm)
        self.launcher: RankLauncher = launcher or MpRankLauncher()
        specs = [RankSpec(r, self._comm, model.config, model.weights, dtype,
                          _rank_device(device, r), threads, model_name, model_version,
                          os.getpid())
                 for r in range(layout.world_size)]
        comms = None
        try:
            self.launcher.start(specs[1:])
            comms = connect(self._comm, 0)
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
        self.launcher.watch(self._rank_exited)
        log.info("%s ranks ready: %s", layout.name,
                 ", ".join(f"rank {r.rank} pid {r.pid} {r.weight_bytes / 2**20:.0f} MiB"
                           for r in self.reports))

    # --- ModelExecutor -------------------------------------------------------------------------

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

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Rank 0 runs the whole input; the others get only what they compute with, unless
        one of them samples (several pipeline stages)."""
        step = Step(model_input)
        wire = step if self.layout.sampling_rank != 0 else StepRows.of(model_input)
        output = self._run(step, wire)
        assert isinstance(output, dict)
        return output

    # --- KVTransfer ----------------------------------------------------------------------------

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Whole-model payloads (as a T=1 instance writes them), assembled from every rank."""
        parts = self._run(ExportKV(block_ids))
        assert isinstance(parts, list) and self.kv_codec is not None
        whole = torch.empty((len(block_ids), *self.rank.whole_block_shape()),
                            dtype=torch.uint8)
        for rank, part in enumerate(parts):
            shard = self.layout.shard(rank, self.config)
            whole[:, shard.layers.start : shard.layers.stop, :, :,
                  shard.kv_heads.start : shard.kv_heads.stop] = part
        return [self.kv_codec.encode(block.numpy().tobytes()) for block in whole]

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> int:
        """Checks payloads here, in order, until one is refused; every rank writes its slices
        of the accepted ones."""
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

    # --- health, memory, shutdown --------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.failure is None

    def rank_memory(self) -> list[RankMemory]:
        """Weight and KV bytes of every rank (KV: 0 before `allocate_kv_cache`)."""
        return [RankMemory(r.rank, r.pid, r.weight_bytes,
                           self._num_slots * self._rank_kv_bytes_per_token(r.rank))
                for r in self.reports]

    def comm_seconds(self) -> float:
        """Rank 0's time inside collectives so far (waiting for slower peers included)."""
        groups = {id(g): g for g in (self.rank.comms.world, self.rank.comms.tp)}
        return sum(getattr(g, "comm_ns", 0) for g in groups.values()) / 1e9

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (idempotent)."""
        if self.failure is None:
            try:
                self._broadcast(Stop())
            except RankFailedError:
                pass
        self.failure = self.failure or RankFailedError("the executor was shut down")
        self.launcher.stop(timeout_s)
        self.rank.comms.close()

    # --- plumbing ------------------------------------------------------------------------------

    def _run(self, command: Command,
             wire: Command | None = None) -> ModelOutput | list[Tensor] | None:
        """Broadcast `wire` (default: `command`), then run `command` as rank 0."""
        if self.failure is not None:
            raise self.failure
        try:
            self._broadcast(wire or command)
            with torch.inference_mode():
                return self.rank.run(command)
        except RankFailedError as exc:
            self._fail(exc)
            raise
        except BaseException as exc:  # rank 0 broke off mid-command: the others wait in vain
            self._fail(RankFailedError(f"rank 0 failed mid-command: {exc!r}", rank=0))
            raise

    def _broadcast(self, command: Command) -> None:
        start = time.perf_counter_ns()
        data = encode(command)
        self.stats.encode_ns += time.perf_counter_ns() - start
        self.stats.num_steps += isinstance(command, Step | StepRows)
        self.stats.num_bytes += len(data)
        self.rank.comms.world.broadcast_bytes(data, root=0)

    def _rank_exited(self, exc: RankFailedError) -> None:
        """The launcher's watcher: a rank process ended while the instance was serving."""
        log.error("%s", exc)
        self._fail(exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    def _fail(self, exc: RankFailedError) -> None:
        if self.failure is None:
            self.failure = exc
        for group in (self.rank.comms.world, self.rank.comms.tp):
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


def _comm_spec(layout: ParallelLayout, device: str, timeout_s: float) -> CommSpec:
    """Shared memory when this host can build it and the model is on the CPU (every mp rank is
    local); otherwise torch.distributed on a local rendezvous."""
    if device == "cpu" and shm.is_available():
        shm.sweep_stale_segments()
        return CommSpec(layout, shm.new_segment_prefix(), device=device, timeout_s=timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    log.warning("shared-memory collectives unavailable: ranks talk through %s", backend)
    return CommSpec(layout, shm.new_segment_prefix(), world_backend=backend, tp_backend=backend,
                    init_method=f"tcp://127.0.0.1:{_free_port()}", device=device,
                    timeout_s=timeout_s)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["ParallelExecutor", "RankMemory", "StepStats"]
