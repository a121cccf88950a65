"""Two ranks in two Linux network namespaces, each with its own address on a veth pair, as two
machines on one link (needs root: CAP_NET_ADMIN). Used by tests/model/parallel/test_netns.py
and bench/netns_gloo.py.

`pair(...)` makes the namespaces and the link, starts rank 0 and rank 1 (this file run as a
script, `--worker R`) in them, and removes both at the end. A worker joins a T=2 gloo group
with the heartbeats, checks an all-reduce's sum, measures (`--iters` > 0: rank 0 prints
medians), then with `--loop` all-reduces until a `RankFailedError` (rank 0 prints when and
whom it names) and exits 3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

NS = (f"strata-a-{os.getpid()}", f"strata-b-{os.getpid()}")
VETH = (f"sva{os.getpid() % 100000}", f"svb{os.getpid() % 100000}")
ADDR = ("10.231.0.1", "10.231.0.2")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def make_link() -> None:
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, addr in zip(NS, VETH, ADDR, strict=True):
        sh("ip", "link", "set", veth, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", veth, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def remove_link() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def worker(rank: int, address: str, port: int, liveness: int, iters: int, loop: bool) -> None:
    """One rank: join, check a sum, measure (rank 0 prints), then with `loop` all-reduce until
    failure."""
    import torch

    from strata.errors import RankFailedError
    from strata.model.parallel.comm import CommSpec, connect
    from strata.model.parallel.layout import ParallelLayout

    spec = CommSpec(ParallelLayout(tensor_size=2), f"netns-{port}", world_backend="gloo",
                    tp_backend="gloo", init_method=f"tcp://{address}:{port}", timeout_s=60,
                    liveness_port=liveness)
    comms = connect(spec, rank)
    group = comms.tp
    summed = group.all_reduce(torch.full((4,), float(rank + 1)))
    if rank == 0:
        print(f"sum {summed.tolist()}", flush=True)
    for rows in (1, 32) if iters else ():
        x = torch.ones(rows, 576)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            group.all_reduce(x)
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"all-reduce {rows} x 576 floats: median {statistics.median(times) * 1e6:.0f} us",
                  flush=True)
    hidden = torch.ones(32, 576)
    times = [0.0]
    for _ in range(iters):
        start = time.perf_counter()
        if rank == 0:
            group.send(hidden, 1)
            group.recv(hidden, 1)
        else:
            group.recv(hidden, 0)
            group.send(hidden, 0)
        times.append((time.perf_counter() - start) / 2)
    if rank == 0 and iters:
        print(f"hand-off 32 x 576 floats (one way): median "
              f"{statistics.median(times) * 1e6:.0f} us", flush=True)
    group.barrier()
    if not loop:
        comms.close()
        return
    if rank == 0:
        print("looping", flush=True)
    x = torch.ones(576)
    try:
        while True:
            group.all_reduce(x)
    except RankFailedError as exc:
        if rank == 0:
            print(f"failed at {time.monotonic():.6f} rank {exc.rank}: {exc}", flush=True)
    os._exit(3)


def _start(rank: int, ns: str | None, address: str, port: int, liveness: int, iters: int,
           loop: bool) -> subprocess.Popen[str]:
    argv = [sys.executable, __file__, "--worker", str(rank), "--address", address, "--port",
            str(port), "--liveness", str(liveness), "--iters", str(iters)]
    argv += ["--loop"] if loop else []
    prefix = ["ip", "netns", "exec", ns] if ns else []
    env = dict(os.environ)
    if ns:  # gloo binds where the host name resolves (the loopback) unless told the interface
        env["GLOO_SOCKET_IFNAME"] = VETH[rank]
    return subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE, text=True, env=env)


def run_pair(ns: tuple[str, str] | None, address: str, iters: int, loop: bool,
             port: int) -> tuple[list[str], float | None, list[int | None]]:
    """Both ranks; rank 0's lines, with `loop` the seconds from the cut to its failure, and the
    exit codes (None: killed after 10 s)."""
    procs = [_start(r, ns[r] if ns else None, address, port, port + 1, iters, loop)
             for r in (0, 1)]
    out = procs[0].stdout
    assert out is not None
    lines, detected = [], None
    for line in out:
        lines.append(line.rstrip())
        if line.startswith("looping") and ns is not None:
            time.sleep(0.5)  # a few hundred all-reduces first
            cut = time.monotonic()
            sh("ip", "-n", ns[1], "link", "set", VETH[1], "down")
        if line.startswith("failed at"):
            detected = float(line.split()[2]) - cut
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(10))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
        if proc.stdout is not None:
            proc.stdout.close()
    return lines, detected, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--liveness", type=int, required=True)
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--loop", action="store_true")
    args = parser.parse_args()
    worker(args.worker, args.address, args.port, args.liveness, args.iters, args.loop)


if __name__ == "__main__":
    main()
