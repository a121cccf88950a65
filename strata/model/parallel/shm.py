"""Shared-memory collectives for the ranks of one host, over `csrc/shm_comm.c`.

A group's segment lives in /dev/shm under a name unique to the instance
(`strata-<creator pid>-<token>-<group>`): `ShmGroup.create` makes it, each rank `attach`es, and
the creator unlinks the name once every rank has mapped it (`unlink`), so a crash leaves no file
behind; segments of creators that died before that point are swept by the next `create`.
Every call waits at most `timeout_s` (the group's default, or `math.inf` for an idle wait) and
raises `RankFailedError` when a peer died, timed out, or another rank reported a failure.

The C side's generations, parities and waiting strategy are described in shm_comm.c. Calls go
through ctypes, which releases the GIL while a rank waits.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from strata.errors import ConfigError, RankFailedError
from strata.model.kernel_build import shm_collectives

SHM_DIR = Path("/dev/shm")
DEFAULT_BUFFER_BYTES = 4 << 20  # per rank and parity; larger messages go in chunks
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_STALE = re.compile(r"strata-(\d+)-[0-9a-f]+-\w+")
_ERRORS = {-1: "did not reach the collective within {timeout}", -2: "died",
           -3: "was reported failed by another rank", -4: "got a malformed request"}


def _library() -> ctypes.CDLL:
    build = shm_collectives()
    if build.library is None:
        raise ConfigError("the shared-memory collectives cannot be built "
                          f"({build.error or 'no C compiler'}); use the gloo backend")
    return build.library


def is_available() -> bool:
    """Whether this host can build the collectives and has a /dev/shm."""
    return SHM_DIR.is_dir() and shm_collectives().is_built


def new_segment_prefix() -> str:
    """A name prefix unique to this instance: `strata-<pid>-<token>`."""
    return f"strata-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_stale_segments() -> list[str]:
    """Unlink segments whose creating process is gone (left by a crash before `unlink`)."""
    removed = []
    for path in SHM_DIR.glob("strata-*"):
        m = _STALE.fullmatch(path.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _to_ns(timeout_s: float) -> int:
    return -1 if math.isinf(timeout_s) else int(timeout_s * 1e9)


class ShmGroup:
    """One rank's handle on a group's segment. Not thread-safe: one thread calls it (except
    `abort`, which any thread may call)."""

    def __init__(self, name: str, rank: int, handle: int, world_size: int,
                 timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._handle: int | None = handle
        self._lib = _library()
        self.comm_ns = 0  # time spent inside collectives (waiting included), for the benchmarks
        self.num_calls = 0

    @staticmethod
    def create(name: str, world_size: int, *, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
               p2p: bool = False, depth: int = 2) -> None:
        """Create the segment `name` (at /dev/shm/NAME) for `world_size` ranks; broadcasts and
        point-to-point messages may run `depth` (>= 2) messages ahead of their readers."""
        rc = _library().shm_create(f"/{name}".encode(), world_size, buffer_bytes, int(p2p),
                                   depth)
        if rc != 0:
            raise OSError(-rc, f"cannot create shared memory segment {name}: "
                               f"{os.strerror(-rc) if rc < -4 else 'bad arguments'}")

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, *,
               timeout_s: float = 60.0) -> ShmGroup:
        handle = _library().shm_attach(f"/{name}".encode(), rank)
        if not handle:
            raise OSError(f"cannot attach shared memory segment {name} as rank {rank}")
        return cls(name, rank, handle, world_size, timeout_s)

    @staticmethod
    def unlink(name: str) -> None:
        (SHM_DIR / name).unlink(missing_ok=True)

    def wait_attached(self, timeout_s: float) -> None:
        """Wait until every rank attached; raises RankFailedError naming one that did not."""
        self._check(self._lib.shm_wait_attached(self._ctx, _to_ns(timeout_s)), timeout_s)

    # --- collectives ---------------------------------------------------------------------------

    def all_reduce(self, x: Tensor, *, timeout_s: float | None = None) -> Tensor:
        """Sum `x` (contiguous float32 / bfloat16 on CPU) over the group, in place."""
        code = _DTYPE_CODES.get(x.dtype)
        if code is None or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"shm all_reduce takes contiguous float32/bfloat16 CPU tensors, "
                             f"got {x.dtype} on {x.device}")
        self._call(self._lib.shm_all_reduce, x.data_ptr(), x.numel(), code,
                   timeout_s=timeout_s)
        return x

    def gather(self, x: Tensor, widths: Sequence[int], root: int | None = None, *,
               timeout_s: float | None = None) -> Tensor | None:
        """Rank r's x is (rows, widths[r]); returns (rows, sum(widths)) with every rank's columns
        in rank order, on every rank (root None) or on `root` only (None elsewhere)."""
        rows = x.shape[0]
        x = x.contiguous()
        item = x.element_size()
        row_bytes = (ctypes.c_int64 * len(widths))(*[w * item for w in widths])
        out = None
        if root is None or root == self.rank:
            out = torch.empty((rows, sum(widths)), dtype=x.dtype)
        self._call(self._lib.shm_gather_rows, x.data_ptr(), rows, row_bytes,
                   out.data_ptr() if out is not None else None,
                   -1 if root is None else root, timeout_s=timeout_s)
        return out

    def broadcast_bytes(self, data: bytes | None, root: int = 0, *,
                        timeout_s: float | None = None) -> bytes:
        """Root passes `data`; every rank returns it. Others pass None."""
        if self.rank == root:
            assert data is not None, "invariant broadcast_root_has_data"
            self._call(self._lib.shm_broadcast_send, data, len(data), timeout_s=timeout_s)
            return data
        size = self._call(self._lib.shm_broadcast_len, root, timeout_s=timeout_s)
        buf = bytearray(size)
        self._call(self._lib.shm_broadcast_recv, root, _addr(buf), size, timeout_s=timeout_s)
        return bytes(buf)

    def send_bytes(self, data: bytes | memoryview, dst: int, *,
                   timeout_s: float | None = None) -> None:
        """To one rank (segments created with p2p)."""
        view = memoryview(data).cast("B")
        ptr = _addr(view) if not view.readonly else bytes(view)
        self._call(self._lib.shm_send, dst, ptr, view.nbytes, timeout_s=timeout_s)

    def recv_bytes(self, src: int, *, timeout_s: float | None = None) -> bytes:
        size = self._call(self._lib.shm_recv_len, src, timeout_s=timeout_s)
        buf = bytearray(size)
        self._call(self._lib.shm_recv, src, _addr(buf), size, timeout_s=timeout_s)
        return bytes(buf)

    def send(self, x: Tensor, dst: int, *, timeout_s: float | None = None) -> None:
        x = x.contiguous()
        self._call(self._lib.shm_send, dst, x.data_ptr(), x.numel() * x.element_size(),
                   timeout_s=timeout_s)

    def recv(self, out: Tensor, src: int, *, timeout_s: float | None = None) -> Tensor:
        """Into `out` (contiguous), which must have the size the sender sent."""
        size = self._call(self._lib.shm_recv_len, src, timeout_s=timeout_s)
        if size != out.numel() * out.element_size():
            raise RuntimeError(f"invariant p2p_sizes_agree: rank {src} sent {size} bytes, "
                               f"rank {self.rank} expects {out.numel() * out.element_size()}")
        self._call(self._lib.shm_recv, src, out.data_ptr(), size, timeout_s=timeout_s)
        return out

    def barrier(self, *, timeout_s: float | None = None) -> None:
        self._call(self._lib.shm_barrier, timeout_s=timeout_s)

    def abort(self, rank: int) -> None:
        """Declare `rank` failed: every wait of every rank of the group stops at once."""
        if self._handle is not None:
            self._lib.shm_abort(self._handle, rank)

    def close(self) -> None:
        if self._handle is not None:
            self._lib.shm_detach(self._handle)
            self._handle = None

    # --- plumbing ------------------------------------------------------------------------------

    @property
    def _ctx(self) -> int:
        if self._handle is None:
            raise RuntimeError(f"invariant attached: group {self.name} is closed")
        return self._handle

    def _call(self, fn: Callable[..., int], *args: object, timeout_s: float | None) -> int:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter_ns()
        rc = int(fn(self._ctx, *args, _to_ns(timeout)))
        self.comm_ns += time.perf_counter_ns() - start
        self.num_calls += 1
        self._check(rc, timeout)
        return rc

    def _check(self, rc: int, timeout_s: float) -> None:
        if rc >= 0:
            return
        failed = int(self._lib.shm_failed_rank(self._ctx))
        what = _ERRORS.get(rc, f"failed ({rc})").format(timeout=f"{timeout_s:g} s")
        raise RankFailedError(f"rank {failed} of group {self.name} {what} "
                              f"(seen by rank {self.rank})", rank=failed)


def _addr(buf: bytearray | memoryview) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
