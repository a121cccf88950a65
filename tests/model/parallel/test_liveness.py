"""Ranks on several hosts find a lost peer within seconds (strata/model/parallel/liveness.py).

A peer whose node is lost closes nothing, so gloo alone waits out its timeout (a day for an idle
worker). The heartbeat protocol is checked here in-process against a raw socket that says hello
and then nothing (a frozen or cut-off peer), or hangs up; a real rank frozen mid-step fails the
step within 5 s in test_pipeline_ranks.py (it reuses that file's two-host instance).
"""

from __future__ import annotations

import socket
import threading
import time

from strata.errors import RankFailedError
from strata.model.parallel.comm import free_port
from strata.model.parallel.liveness import _HELLO, Liveness


def _served(**timing: float) -> tuple[Liveness, int, list[RankFailedError], threading.Event]:
    port = free_port("127.0.0.1")
    lost: list[RankFailedError] = []
    event = threading.Event()

    def on_lost(exc: RankFailedError) -> None:
        lost.append(exc)
        event.set()

    return Liveness.serve("127.0.0.1", port, 2, on_lost, **timing), port, lost, event


def _peer(port: int, rank: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(_HELLO.pack(rank))
    return sock


def test_a_silent_peer_is_lost_after_the_deadline_and_named() -> None:
    server, port, lost, event = _served(interval_s=0.05, deadline_s=0.3)
    silent = _peer(port, 2)
    start = time.monotonic()
    try:
        assert event.wait(5.0)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
        silent.close()
    assert 0.3 <= elapsed < 2.0
    assert len(lost) == 1 and lost[0].rank == 2
    assert "rank 2 sent no heartbeat for 0.3 s" in str(lost[0])


def test_a_peer_that_hangs_up_is_lost_at_once_and_the_others_are_cut_off() -> None:
    server, port, lost, event = _served(interval_s=0.05, deadline_s=30.0)
    other, leaving = _peer(port, 1), _peer(port, 2)
    try:
        other.recv(1)  # both accepted and beating
        leaving.recv(1)
        leaving.close()
        assert event.wait(5.0)
        other.settimeout(5.0)
        while other.recv(64):  # rank 0 closes the other peers' connections: they fail too
            pass
    finally:
        server.stop()
        other.close()
    assert [e.rank for e in lost] == [2]
    assert "closed its liveness connection" in str(lost[0])


def test_a_planned_end_is_no_loss() -> None:
    server, port, lost, event = _served(interval_s=0.05, deadline_s=30.0)
    peer = _peer(port, 1)
    peer.recv(1)
    server.expect_end()
    peer.close()
    assert not event.wait(0.3)
    server.stop()
    assert lost == []
