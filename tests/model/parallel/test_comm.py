"""`connect` wires a rank's two groups over shared memory or over torch.distributed (gloo); the
same calls give the same answers through both."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch
from model.parallel import shm_workers as workers

from strata.errors import ConfigError
from strata.model.parallel.comm import CommSpec, create_segments
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shm import ShmGroup, new_segment_prefix

CTX = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_both_backends_answer_alike(backend: str) -> None:
    layout = ParallelLayout(tensor_size=2)
    init = f"tcp://127.0.0.1:{free_port()}" if backend == "gloo" else None
    spec = CommSpec(layout, new_segment_prefix(), world_backend=backend, tp_backend=backend,
                    init_method=init, timeout_s=30)
    names = create_segments(spec)
    procs, conns = [], []
    try:
        for rank in range(2):
            ours, theirs = CTX.Pipe()
            proc = CTX.Process(target=workers.through_connect, args=(spec, rank, theirs))
            proc.start()
            procs.append(proc)
            conns.append(ours)
        results = [conn.recv() for conn in conns]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for name in names:
            ShmGroup.unlink(name)
    expected = workers.rank_input(0, 576, "float32") + workers.rank_input(1, 576, "float32")
    for rank, (summed, gathered, step, received) in enumerate(results):
        torch.testing.assert_close(workers.unpack(summed), expected, rtol=0, atol=0)
        assert step == b"step"
        if rank == 0:
            assert torch.equal(workers.unpack(gathered),
                               torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
        else:
            assert gathered is None
            assert received[0] == b"tokens"
            assert torch.equal(workers.unpack(received[1]), torch.arange(4.0))


def test_a_torch_group_needs_a_rendezvous() -> None:
    with pytest.raises(ConfigError, match="init_method"):
        CommSpec(ParallelLayout(tensor_size=2), "p", tp_backend="gloo")
    with pytest.raises(ConfigError, match="choose one of shm, gloo, nccl"):
        CommSpec(ParallelLayout(tensor_size=2), "p", tp_backend="mpi")
