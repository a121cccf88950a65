"""How ranks talk: the `Communicator` protocol, its two implementations and the per-rank wiring.

Each rank has two groups (`RankComms`): `world` (every rank: the step's input broadcast from rank
0, hidden states passed stage to stage, sampled tokens sent back to rank 0) and `tp` (the ranks
of its pipeline stage: the row-parallel sums and the LM head's gather). A group is either

- `ShmGroup` (shm.py): shared memory, for ranks on one host. About 20x cheaper than gloo for the
  small sums of decode (gloo costs >= 0.64 ms a call here, 60 calls per SmolLM2 decode step).
- `TorchDistGroup`: torch.distributed, gloo on CPU or NCCL on CUDA, for ranks on several hosts.

`CommSpec` (picklable: it travels to spawned processes and Ray actors) says which backend each
group uses; "shm" needs every rank of the group on one host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from strata.errors import ConfigError
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shm import ShmGroup

BACKENDS = ("shm", "gloo", "nccl")


class Communicator(Protocol):
    """Collectives of one group; `rank` and every root/src/dst are ranks within the group.

    Contract: every rank of the group calls the same collectives in the same order. A call that
    cannot complete (a peer died, a timeout) raises `RankFailedError`; the group is then unusable.
    `timeout_s` None means the group's default; `math.inf` waits for ever (liveness still checked
    where the backend can).
    """

    rank: int
    world_size: int

    def all_reduce(self, x: Tensor, *, timeout_s: float | None = None) -> Tensor:
        """Sum over the group, in place; bit-identical on every rank."""
        ...

    def gather(self, x: Tensor, widths: Sequence[int], root: int | None = None, *,
               timeout_s: float | None = None) -> Tensor | None:
        """Concatenate rank r's (rows, widths[r]) along columns, on `root` (None: on all)."""
        ...

    def broadcast_bytes(self, data: bytes | None, root: int = 0, *,
                        timeout_s: float | None = None) -> bytes: ...

    def send(self, x: Tensor, dst: int, *, timeout_s: float | None = None) -> None: ...

    def recv(self, out: Tensor, src: int, *, timeout_s: float | None = None) -> Tensor: ...

    def send_bytes(self, data: bytes, dst: int, *, timeout_s: float | None = None) -> None: ...

    def recv_bytes(self, src: int, *, timeout_s: float | None = None) -> bytes: ...

    def barrier(self, *, timeout_s: float | None = None) -> None: ...

    def abort(self, rank: int) -> None:
        """Declare `rank` failed so that the group's waits stop (best effort)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CommSpec:
    """How every rank of one instance connects; the same value on every rank."""

    layout: ParallelLayout
    prefix: str  # shm segment names: <prefix>-world, <prefix>-tp<stage>
    world_backend: str = "shm"
    tp_backend: str = "shm"
    init_method: str | None = None  # torch.distributed rendezvous, e.g. tcp://10.0.0.1:29500
    device: str = "cpu"
    timeout_s: float = 60.0  # one collective

    def __post_init__(self) -> None:
        for backend in (self.world_backend, self.tp_backend):
            if backend not in BACKENDS:
                raise ConfigError(f"communication backend {backend!r} is unknown; choose one "
                                  f"of {', '.join(BACKENDS)}")
        if self.uses_torch and self.init_method is None:
            raise ConfigError("a torch.distributed group needs an init_method "
                              "(e.g. tcp://HOST:PORT)")

    @property
    def uses_torch(self) -> bool:
        return self.world_backend != "shm" or self.tp_backend != "shm"

    def segment(self, group: str) -> str:
        return f"{self.prefix}-{group}"


@dataclass(slots=True)
class RankComms:
    world: Communicator
    tp: Communicator

    def close(self) -> None:
        self.tp.close()
        self.world.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def create_segments(spec: CommSpec) -> list[str]:
    """Create the shm segments of `spec` (on the host of rank 0, before any rank attaches)."""
    names = []
    if spec.world_backend == "shm":
        names.append(spec.segment("world"))
        ShmGroup.create(names[-1], spec.layout.world_size, p2p=True)
    if spec.tp_backend == "shm":
        for stage in range(spec.layout.pipeline_size):
            names.append(spec.segment(f"tp{stage}"))
            ShmGroup.create(names[-1], spec.layout.tensor_size)
    return names


def connect(spec: CommSpec, rank: int) -> RankComms:
    """Join both groups of `rank` (every rank calls this, in any order, at about the same time)."""
    layout = spec.layout
    stage, tp_rank = layout.coords(rank).stage, layout.coords(rank).tp_rank
    tp_groups: list[TorchDistGroup] = []
    world: Communicator
    if spec.uses_torch:
        world_torch, tp_groups = _init_torch(spec, rank)
    if spec.world_backend == "shm":
        world = ShmGroup.attach(spec.segment("world"), rank, layout.world_size,
                                timeout_s=spec.timeout_s)
    else:
        world = world_torch
    tp: Communicator
    if spec.tp_backend == "shm":
        tp = ShmGroup.attach(spec.segment(f"tp{stage}"), tp_rank, layout.tensor_size,
                             timeout_s=spec.timeout_s)
    else:
        tp = tp_groups[stage]
    return RankComms(world, tp)


def _init_torch(spec: CommSpec, rank: int) -> tuple[TorchDistGroup, list[TorchDistGroup]]:
    """The default group (world) and one group per stage: every rank creates all, in order."""
    layout = spec.layout
    backend = "nccl" if "nccl" in (spec.world_backend, spec.tp_backend) else "gloo"
    # The world group's timeout covers an idle worker's wait for the next step.
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank,
                            world_size=layout.world_size, timeout=timedelta(days=1))
    timeout = timedelta(seconds=spec.timeout_s)
    device = torch.device(spec.device)
    world = TorchDistGroup(list(range(layout.world_size)), rank, device,
                           dist.new_group(list(range(layout.world_size)), timeout=timeout))
    stages = []
    for stage in range(layout.pipeline_size):
        ranks = layout.stage_ranks(stage)
        group = dist.new_group(ranks, timeout=timeout)
        stages.append(TorchDistGroup(ranks, rank, device, group))
    return world, stages


class TorchDistGroup:
    """A `Communicator` over a torch.distributed process group (gloo or NCCL).

    Per-call timeouts are the group's own (set at creation): `timeout_s` is ignored. Broadcasts
    over every rank go through the default group, whose timeout is long: an idle worker waits
    in one for the next step.
    """

    def __init__(self, ranks: list[int], global_rank: int, device: torch.device,
                 group: dist.ProcessGroup | None) -> None:
        self.ranks = ranks
        self.rank = ranks.index(global_rank) if global_rank in ranks else -1
        self.world_size = len(ranks)
        self.device = device
        self.group = group
        self.comm_ns = 0
        self.num_calls = 0

    def all_reduce(self, x: Tensor, *, timeout_s: float | None = None) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: Tensor, widths: Sequence[int], root: int | None = None, *,
               timeout_s: float | None = None) -> Tensor | None:
        widest = max(widths)
        padded = torch.zeros((x.shape[0], widest), dtype=x.dtype, device=x.device)
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in widths]
        dist.all_gather(parts, padded, group=self.group)
        if root is not None and root != self.rank:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def broadcast_bytes(self, data: bytes | None, root: int = 0, *,
                        timeout_s: float | None = None) -> bytes:
        whole = self.world_size == dist.get_world_size()
        group = None if whole else self.group  # the default group: see the class docstring
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64,
                            device=self.device)
        dist.broadcast(size, src=self.ranks[root], group=group)
        if self.rank == root:
            assert data is not None, "invariant broadcast_root_has_data"
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if payload.numel():
            dist.broadcast(payload, src=self.ranks[root], group=group)
        return data if data is not None else payload.cpu().numpy().tobytes()

    def send(self, x: Tensor, dst: int, *, timeout_s: float | None = None) -> None:
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, out: Tensor, src: int, *, timeout_s: float | None = None) -> Tensor:
        dist.recv(out, src=self.ranks[src], group=self.group)
        return out

    def send_bytes(self, data: bytes, dst: int, *, timeout_s: float | None = None) -> None:
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.send(size, dst)
        if data:
            self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), dst)

    def recv_bytes(self, src: int, *, timeout_s: float | None = None) -> bytes:
        size = self.recv(torch.empty(1, dtype=torch.int64, device=self.device), src)
        if not int(size.item()):
            return b""
        out = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        return bytes(self.recv(out, src).cpu().numpy().tobytes())

    def barrier(self, *, timeout_s: float | None = None) -> None:
        dist.barrier(group=self.group)

    def abort(self, rank: int) -> None:
        """gloo and NCCL have no abort word: peers learn from the closed connection or their
        timeout."""

    def close(self) -> None:
        """The process group goes with `RankComms.close`."""
