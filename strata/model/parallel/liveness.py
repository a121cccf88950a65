"""Peer liveness for ranks on several hosts: heartbeats to rank 0, and severing gloo's sockets.

Shared memory checks its peers' pids in every wait (shm.py), but a gloo wait has no such check:
a peer that exits closes its TCP connections and the wait fails at once, while a peer whose node
is lost (powered off, cut off the network, frozen) closes nothing, and gloo waits out the group's
timeout (the default group's is a day: an idle worker waits in it for the next step). Nor can a
blocked gloo call be interrupted (`ProcessGroupGloo.abort` does not wake it; a wait with a short
timeout breaks the pair for good).

So each rank other than 0 keeps one TCP connection to rank 0 (`LivenessServer`, at rank 0's
address), and both ends send a byte every `interval_s`. An end that reads nothing for
`deadline_s`, or reads the connection's end, declares the peer lost (`on_lost`, once) and the
rank fails its groups by shutting down the sockets that torch.distributed opened in this process
(`GlooSockets.sever`): every gloo call, blocked or later, then raises at once. Rank 0 closes
every heartbeat connection when one peer is lost, so the others fail too (a star is enough: no
rank but 0 can go on without every peer). Detection takes at most `deadline_s` plus one interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable

from strata.errors import RankFailedError

log = logging.getLogger("strata.model.parallel")
OnLost = Callable[[RankFailedError], None]
INTERVAL_S = 0.5
DEADLINE_S = 2.0
_HELLO = struct.Struct("!I")
_BEAT = b"\x01"


def socket_fds() -> set[int]:
    """The file descriptors of this process that are sockets (Linux: /proc/self/fd)."""
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(f"/proc/self/fd/{name}").st_mode):
                    found.add(int(name))
    return found


class GlooSockets:
    """The sockets torch.distributed opened while this process joined its groups (those that
    appeared between `__init__` and `taken`), so that they can be shut down. A socket another
    thread opened in that window is taken too (e.g. a Ray driver's): it is shut down only when
    the instance fails, which ends the process anyway."""

    def __init__(self) -> None:
        self._before = socket_fds()
        self._fds: set[int] = set()
        self._lock = threading.Lock()
        self.severed = False

    def taken(self) -> None:
        """Call once the groups exist: the sockets opened since `__init__` are gloo's."""
        self._fds = socket_fds() - self._before

    def sever(self) -> None:
        """Shut down every gloo socket (idempotent): every gloo call of this process raises."""
        with self._lock:
            if self.severed:
                return
            self.severed = True
            for fd in self._fds:
                with contextlib.suppress(OSError):  # closed meanwhile, or not connected
                    sock = socket.socket(fileno=os.dup(fd))
                    try:  # a listener stays: gloo's accept thread aborts the process on it
                        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                            sock.shutdown(socket.SHUT_RDWR)
                    finally:
                        sock.close()


class _Beat:
    """One heartbeat connection with `peer` (a rank), on its own thread."""

    def __init__(self, sock: socket.socket, peer: int, on_lost: Callable[[int, str], None],
                 *, interval_s: float, deadline_s: float) -> None:
        self.sock, self.peer, self.on_lost = sock, peer, on_lost
        self.interval_s, self.deadline_s = interval_s, deadline_s
        self.stopping = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"strata-beat-{peer}").start()

    def _run(self) -> None:
        why = self._beat_until_lost()
        if why is not None and not self.stopping.is_set():
            self.on_lost(self.peer, why)
        self.sock.close()

    def _beat_until_lost(self) -> str | None:
        last_seen = next_beat = time.monotonic()
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                try:
                    self.sock.send(_BEAT)
                except OSError:
                    return "closed its liveness connection"
                next_beat = now + self.interval_s
            readable, _, _ = select.select([self.sock], [], [], max(0.0, next_beat - now))
            if readable:
                try:
                    data = self.sock.recv(64)
                except OSError:
                    data = b""
                if not data:
                    return "closed its liveness connection"
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > self.deadline_s:
                return f"sent no heartbeat for {self.deadline_s:g} s"
        return None

    def stop(self) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class Liveness:
    """Heartbeats of one rank: rank 0 serves a connection per peer, the others connect to it.
    `on_lost` gets a `RankFailedError` naming the lost rank, once; `stop` before a planned exit
    (a peer's end of its connection is then no loss)."""

    def __init__(self, on_lost: OnLost, *, interval_s: float = INTERVAL_S,
                 deadline_s: float = DEADLINE_S) -> None:
        self._on_lost, self.interval_s, self.deadline_s = on_lost, interval_s, deadline_s
        self._beats: list[_Beat] = []
        self._lock = threading.Lock()
        self._lost = False
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    @classmethod
    def serve(cls, address: str, port: int, peers: int, on_lost: OnLost,
              **timing: float) -> Liveness:
        """Rank 0: accept the heartbeat connections of `peers` ranks on address:port."""
        self = cls(on_lost, **timing)
        self._listener = socket.create_server((address, port))
        threading.Thread(target=self._accept, args=(peers,), daemon=True,
                         name="strata-liveness").start()
        return self

    @classmethod
    def join(cls, address: str, port: int, rank: int, on_lost: OnLost, *, timeout_s: float,
             **timing: float) -> Liveness:
        """A rank other than 0: connect to rank 0 (retrying until `timeout_s`: it may not
        listen yet) and say which rank this is."""
        self = cls(on_lost, **timing)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RankFailedError(f"rank {rank} could not reach rank 0's liveness "
                                          f"port {address}:{port}", rank=0) from None
                time.sleep(0.02)
        sock.sendall(_HELLO.pack(rank))
        self._add(sock, 0)
        return self

    def _accept(self, peers: int) -> None:
        assert self._listener is not None
        for _ in range(peers):
            try:
                sock, _ = self._listener.accept()
                sock.settimeout(5.0)
                (rank,) = _HELLO.unpack(sock.recv(_HELLO.size, socket.MSG_WAITALL))
            except (OSError, struct.error):
                if self._stopping.is_set():
                    return
                continue
            self._add(sock, rank)

    def _add(self, sock: socket.socket, peer: int) -> None:
        sock.setblocking(True)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._beats.append(_Beat(sock, peer, self._lost_peer, interval_s=self.interval_s,
                                     deadline_s=self.deadline_s))

    def _lost_peer(self, peer: int, why: str) -> None:
        with self._lock:
            if self._lost or self._stopping.is_set():
                return
            self._lost = True
            others = [b for b in self._beats if b.peer != peer]
        log.error("rank %d %s: failing this instance", peer, why)
        for beat in others:  # rank 0: the other ranks learn at once
            beat.stop()
        self._on_lost(RankFailedError(f"rank {peer} {why}", rank=peer))

    def expect_end(self) -> None:
        """A planned end is coming (rank 0 is about to stop its peers): their connections'
        end is no loss."""
        self._stopping.set()

    def stop(self) -> None:
        """A planned end: close every connection without declaring anyone lost."""
        self._stopping.set()
        with self._lock:
            beats = list(self._beats)
        for beat in beats:
            beat.stop()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes its accept
            self._listener.close()
