"""How ranks talk: the `Communicator` protocol, its two implementations and the per-rank wiring.

Each rank has two groups (`RankComms`): `world` (every rank: the step's input broadcast from rank
0, hidden states passed stage to stage, sampled tokens sent back to rank 0) and `tp` (the ranks
of its pipeline stage: the row-parallel sums and the LM head's gather). A group is either

- `ShmGroup` (shm.py): shared memory, for ranks on one host. About 20x cheaper than gloo for the
  small sums of decode (gloo costs >= 0.64 ms a call here, 60 calls per SmolLM2 decode step).
- `TorchDistGroup`: torch.distributed, gloo on CPU or NCCL on CUDA, for ranks on several hosts.

`CommSpec` (picklable: it travels to spawned processes and Ray actors) says which backend each
group uses; "shm" needs every rank of the group on one host. `plan_comm` picks them from the
`Host` of every rank, which the launcher knows before any rank starts (mp: this host; Ray: the
node of each bundle of the placement group): shared memory for a group on one host, gloo (NCCL
on CUDA) for a group across hosts. "One host" is an explicit identity (a Ray node id), never
inferred from addresses: two Ray nodes on one machine, each on its own loopback address, are two
hosts, and one host may be reached by several names. A rank learns nothing else about its peers:
the torch.distributed rendezvous is at rank 0's address (`init_method`), and its store
exchanges the peers' addresses. Rank 0 creates the segments on its host; the tp segment of a
stage on another host is created there by the stage's tp rank 0, and its peers wait for it.

With torch.distributed, every rank also keeps a heartbeat connection with rank 0 (liveness.py,
at rank 0's address, port `liveness_port`): a peer lost without closing its connections (its
node gone) fails the groups of every rank within `liveness.DEADLINE_S` plus an interval, where
gloo alone would wait out its timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from strata.errors import ConfigError, RankFailedError
from strata.model.parallel import shm
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.liveness import GlooSockets, Liveness
from strata.model.parallel.shm import ShmGroup
from strata.model.parallel.torch_group import TorchDistGroup

BACKENDS = ("shm", "gloo", "nccl")


@dataclass(frozen=True, slots=True)
class Host:
    """Where a rank runs: `id` names the machine memory it shares (ranks with one id may use
    shared memory), `address` is where its peers reach it."""

    id: str
    address: str


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
    hosts: tuple[str, ...] = ()  # the host id of every rank; () means all on rank 0's host
    liveness_port: int | None = None  # rank 0's heartbeat port (with torch.distributed)

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

    def tp_segment_is_remote(self, stage: int) -> bool:
        """Whether stage `stage` runs on another host than rank 0 (it makes its own segment)."""
        leader = self.layout.rank_of(stage, 0)
        return bool(self.hosts) and self.hosts[leader] != self.hosts[0]


def plan_comm(layout: ParallelLayout, hosts: list[Host], *, device: str, timeout_s: float,
              port: int | None = None) -> CommSpec:
    """Shared memory for each group whose ranks share a host id (on the CPU, where this host
    can build it), torch.distributed for the others, with the rendezvous at rank 0's address
    (this process's: it binds the port there)."""
    if len(hosts) != layout.world_size:
        raise ValueError(f"{len(hosts)} hosts for {layout.world_size} ranks")
    ids = [h.id for h in hosts]
    local = device == "cpu" and shm.is_available()
    fallback = "nccl" if device.startswith("cuda") else "gloo"
    stages_local = all(len({ids[r] for r in layout.stage_ranks(s)}) == 1
                       for s in range(layout.pipeline_size))
    world = "shm" if local and len(set(ids)) == 1 else fallback
    tp = "shm" if local and stages_local else fallback
    if local:
        shm.sweep_stale_segments()
    init, liveness = None, None
    if world != "shm" or tp != "shm":
        address = hosts[0].address
        init = f"tcp://{address}:{port or free_port(address)}"
        liveness = free_port(address)
    return CommSpec(layout, shm.new_segment_prefix(), world_backend=world, tp_backend=tp,
                    init_method=init, device=device, timeout_s=timeout_s, hosts=tuple(ids),
                    liveness_port=liveness)


def free_port(address: str) -> int:
    """A port free now on `address` (of this process's host)."""
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class RankComms:
    world: Communicator
    tp: Communicator
    liveness: Liveness | None = field(default=None)

    def peer_lost(self, exc: RankFailedError) -> None:
        """A peer's heartbeats stopped: fail both groups (their waits raise now, with `exc`)."""
        for group in (self.world, self.tp):
            if isinstance(group, TorchDistGroup) and group.failure is None:
                group.failure = exc
            group.abort(max(exc.rank, 0))

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
        self.tp.close()
        self.world.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def create_segments(spec: CommSpec) -> list[str]:
    """Create the shm segments of `spec` (on the host of rank 0, before any rank attaches)."""
    names = []
    if spec.world_backend == "shm":
        names.append(spec.segment("world"))
        # P + 1 deep: rank 0 broadcasts batch k + P - 1 while the last stage runs batch k.
        ShmGroup.create(names[-1], spec.layout.world_size, p2p=True,
                        depth=max(2, spec.layout.pipeline_size + 1))
    if spec.tp_backend == "shm":
        for stage in range(spec.layout.pipeline_size):
            if not spec.tp_segment_is_remote(stage):
                names.append(spec.segment(f"tp{stage}"))
                ShmGroup.create(names[-1], spec.layout.tensor_size)
    return names


def connect(spec: CommSpec, rank: int,
            on_peer_lost: Callable[[RankFailedError], None] | None = None) -> RankComms:
    """Join both groups of `rank` (every rank calls this, in any order, at about the same time).
    With torch.distributed, a peer lost fails both groups, then calls `on_peer_lost`."""
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
    if spec.tp_backend != "shm":
        tp = tp_groups[stage]
    elif spec.tp_segment_is_remote(stage):
        tp = _attach_remote_stage(spec, stage, tp_rank)
    else:
        tp = ShmGroup.attach(spec.segment(f"tp{stage}"), tp_rank, layout.tensor_size,
                             timeout_s=spec.timeout_s)
    comms = RankComms(world, tp)
    if spec.liveness_port is not None:
        comms.liveness = _start_liveness(spec, rank, comms, on_peer_lost)
    return comms


def _start_liveness(spec: CommSpec, rank: int, comms: RankComms,
                    then: Callable[[RankFailedError], None] | None) -> Liveness:
    assert spec.init_method is not None and spec.liveness_port is not None
    address = spec.init_method.removeprefix("tcp://").rsplit(":", 1)[0]

    def lost(exc: RankFailedError) -> None:
        comms.peer_lost(exc)
        if then is not None:
            then(exc)

    if rank == 0:
        return Liveness.serve(address, spec.liveness_port, spec.layout.world_size - 1, lost)
    return Liveness.join(address, spec.liveness_port, rank, lost, timeout_s=spec.timeout_s)


def _attach_remote_stage(spec: CommSpec, stage: int, tp_rank: int) -> ShmGroup:
    """The tp group of a stage on another host than rank 0: its tp rank 0 creates the segment,
    the others wait for it; it is unlinked once all attached (as rank 0 does with its own)."""
    name, size = spec.segment(f"tp{stage}"), spec.layout.tensor_size
    if tp_rank == 0:
        ShmGroup.create(name, size)
    deadline = time.monotonic() + spec.timeout_s
    while True:
        try:
            group = ShmGroup.attach(name, tp_rank, size, timeout_s=spec.timeout_s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    if tp_rank == 0:
        group.wait_attached(spec.timeout_s)
        ShmGroup.unlink(name)
    return group


def _init_torch(spec: CommSpec, rank: int) -> tuple[TorchDistGroup, list[TorchDistGroup]]:
    """The default group (world) and one group per stage: every rank creates all, in order."""
    layout = spec.layout
    backend = "nccl" if "nccl" in (spec.world_backend, spec.tp_backend) else "gloo"
    sockets = GlooSockets()
    # The default group's timeout covers an idle worker's wait for the next step (a lost peer
    # is found by the heartbeats, not by this timeout).
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank,
                            world_size=layout.world_size, timeout=timedelta(days=1))
    timeout = timedelta(seconds=spec.timeout_s)
    device = torch.device(spec.device)
    world = TorchDistGroup(list(range(layout.world_size)), rank, device,
                           dist.new_group(list(range(layout.world_size)), timeout=timeout),
                           sockets)
    stages = []
    for stage in range(layout.pipeline_size):
        ranks = layout.stage_ranks(stage)
        group = dist.new_group(ranks, timeout=timeout)
        stages.append(TorchDistGroup(ranks, rank, device, group, sockets))
    sockets.taken()
    return world, stages
