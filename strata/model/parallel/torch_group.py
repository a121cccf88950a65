"""`TorchDistGroup`: a `Communicator` over torch.distributed (gloo on CPU, NCCL on CUDA), for
ranks on several hosts (comm.py picks it per group).

Every send is asynchronous (`isend`; the tensor is kept until the send completes): a gloo send
waits until its receiver posts the matching receive, and with batches in flight the receiver may
be busy with an earlier batch, or even waiting in a receive from the sender (the last stage
sends batch k's tokens to rank 0 while rank 0 sends it batch k + 1). With sends that never
block, a rank waits only in receives and collectives, which every peer reaches in order.
The step "broadcast" is therefore one send per rank from the root (one serialization; the same
bytes), on the default group, whose timeout is long: an idle worker waits in it for the next
step.

A peer that exits closes its connections and the call waiting on it raises at once; a peer that
is lost without closing anything is found by the heartbeats (liveness.py), which `abort` the
group: its sockets are shut down, so the blocked call raises too. Either way the call raises
`RankFailedError`, naming the aborted rank where one was named.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from strata.errors import RankFailedError
from strata.model.parallel.liveness import GlooSockets

T = TypeVar("T")
# A peer that exits closes its gloo connections and its heartbeat connection at once: how long
# a failed call waits for the heartbeats to say which rank it was.
BLAME_WAIT_S = 1.0


class TorchDistGroup:
    """A `Communicator` over a torch.distributed process group (gloo or NCCL). Per-call
    timeouts are the group's own (set at creation): `timeout_s` is ignored. `sockets` are this
    process's torch.distributed sockets, shared by all its groups (`abort` shuts them down)."""

    def __init__(self, ranks: list[int], global_rank: int, device: torch.device,
                 group: dist.ProcessGroup | None, sockets: GlooSockets | None = None) -> None:
        self.ranks = ranks
        self.rank = ranks.index(global_rank) if global_rank in ranks else -1
        self.world_size = len(ranks)
        self.device = device
        self.group = group
        self.sockets = sockets
        self.failure: RankFailedError | None = None
        self._aborted = threading.Event()
        self.comm_ns = 0
        self.num_calls = 0
        self._sending: list[tuple[dist.Work, Tensor]] = []

    def all_reduce(self, x: Tensor, *, timeout_s: float | None = None) -> Tensor:
        self._timed(lambda: dist.all_reduce(x, group=self.group))
        return x

    def gather(self, x: Tensor, widths: Sequence[int], root: int | None = None, *,
               timeout_s: float | None = None) -> Tensor | None:
        widest = max(widths)
        padded = torch.zeros((x.shape[0], widest), dtype=x.dtype, device=x.device)
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in widths]
        self._timed(lambda: dist.all_gather(parts, padded, group=self.group))
        if root is not None and root != self.rank:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def broadcast_bytes(self, data: bytes | None, root: int = 0, *,
                        timeout_s: float | None = None) -> bytes:
        whole = self.world_size == dist.get_world_size()
        group = None if whole else self.group  # the default group: see the module docstring
        if self.rank == root:
            assert data is not None, "invariant broadcast_root_has_data"
            for peer in range(self.world_size):
                if peer != root:
                    self._send_bytes(data, peer, group)
            return data
        return self._recv_bytes(root, group)

    def send(self, x: Tensor, dst: int, *, timeout_s: float | None = None) -> None:
        self._send(x.contiguous(), dst, self.group)

    def recv(self, out: Tensor, src: int, *, timeout_s: float | None = None) -> Tensor:
        self._timed(lambda: dist.recv(out, src=self.ranks[src], group=self.group))
        return out

    def send_bytes(self, data: bytes, dst: int, *, timeout_s: float | None = None) -> None:
        self._send_bytes(data, dst, self.group)

    def recv_bytes(self, src: int, *, timeout_s: float | None = None) -> bytes:
        return self._recv_bytes(src, self.group)

    def barrier(self, *, timeout_s: float | None = None) -> None:
        self._timed(lambda: dist.barrier(group=self.group))

    def abort(self, rank: int) -> None:
        """Declare `rank` (global) failed: this process's gloo sockets are shut down, so every
        call of its groups, blocked or later, raises (peers learn from the closed connections).
        """
        if self.failure is None:
            self.failure = RankFailedError(f"rank {rank} failed", rank=rank)
        self._aborted.set()
        if self.sockets is not None:
            self.sockets.sever()

    def close(self) -> None:
        """The process group goes with `RankComms.close` (sends still pending with it)."""
        self._sending.clear()

    # --- plumbing ------------------------------------------------------------------------------

    def _send_bytes(self, data: bytes, dst: int, group: dist.ProcessGroup | None) -> None:
        self._send(torch.tensor([len(data)], dtype=torch.int64, device=self.device), dst, group)
        if data:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self._send(payload, dst, group)

    def _recv_bytes(self, src: int, group: dist.ProcessGroup | None) -> bytes:
        peer = self.ranks[src]
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._timed(lambda: dist.recv(size, src=peer, group=group))
        if not int(size.item()):
            return b""
        out = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._timed(lambda: dist.recv(out, src=peer, group=group))
        return bytes(out.cpu().numpy().tobytes())

    def _send(self, x: Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        """Start sending `x`; it is kept alive until the send completes."""
        self._sending = [(w, t) for w, t in self._sending if not w.is_completed()]
        work = self._timed(lambda: dist.isend(x, dst=self.ranks[dst], group=group))
        if work is not None:
            self._sending.append((work, x))

    def _timed(self, call: Callable[[], T]) -> T:
        start = time.perf_counter_ns()
        try:
            return call()
        except RuntimeError as exc:  # gloo: a closed or severed connection, a timeout
            if self.sockets is not None:  # with heartbeats: they name the rank
                self._aborted.wait(BLAME_WAIT_S)
            if self.failure is not None:
                raise self.failure from exc
            raise RankFailedError(f"a collective of ranks {self.ranks} failed: {exc}") from exc
        finally:
            self.comm_ns += time.perf_counter_ns() - start
            self.num_calls += 1
