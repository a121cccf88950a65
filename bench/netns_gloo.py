"""The inter-node path between two Linux network namespaces (issue 28 item 5): two ranks, each in
its own namespace with its own address on a veth pair, as two machines on one link.

Measured on rank 0: a gloo all-reduce of one decode row (576 floats, SmolLM2-135M's hidden size)
and of 32 rows; a pipeline hand-off of 32 rows of hidden states (send to rank 1 and back, halved);
the same in the root namespace over 127.0.0.1 for comparison. Then the link is cut (`ip link set
... down`: nothing closes, as when a cable is pulled) while rank 0 runs all-reduces, and the time
from the cut to rank 0's `RankFailedError` naming rank 1 is reported. Needs root (CAP_NET_ADMIN).

    sudo PYTHONPATH=. .venv/bin/python bench/netns_gloo.py --iters 300 --cuts 3
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
    """One rank: join, measure (rank 0 prints), then with `loop` all-reduce until failure."""
    import torch

    from strata.errors import RankFailedError
    from strata.model.parallel.comm import CommSpec, connect
    from strata.model.parallel.layout import ParallelLayout

    spec = CommSpec(ParallelLayout(tensor_size=2), f"netns-{port}", world_backend="gloo",
                    tp_backend="gloo", init_method=f"tcp://{address}:{port}", timeout_s=60,
                    liveness_port=liveness)
    comms = connect(spec, rank)
    group = comms.tp
    for rows in (1, 32):
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
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        if rank == 0:
            group.send(hidden, 1)
            group.recv(hidden, 1)
        else:
            group.recv(hidden, 0)
            group.send(hidden, 0)
        times.append((time.perf_counter() - start) / 2)
    if rank == 0:
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
    os._exit(0)


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
             port: int) -> tuple[list[str], float | None]:
    """Both ranks; rank 0's lines, and with `loop` the seconds from the cut to its failure."""
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
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return lines, detected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--cuts", type=int, default=3)
    parser.add_argument("--worker", type=int)
    parser.add_argument("--address")
    parser.add_argument("--port", type=int)
    parser.add_argument("--liveness", type=int)
    parser.add_argument("--loop", action="store_true")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.address, args.port, args.liveness, args.iters, args.loop)
        return
    print("loopback (one namespace, 127.0.0.1):")
    print("\n".join(run_pair(None, "127.0.0.1", args.iters, False, 29710)[0]))
    cuts = []
    for i in range(max(args.cuts, 1)):
        make_link()
        try:
            lines, detected = run_pair(NS, ADDR[0], args.iters, True, 29720 + 2 * i)
        finally:
            remove_link()
        if i == 0:
            print("two namespaces over a veth pair:")
            print("\n".join(lines))
        if detected is not None:
            cuts.append(detected)
    print("link cut to rank 0's failure: " + ", ".join(f"{c * 1e3:.0f}" for c in cuts)
          + f" ms (median {statistics.median(cuts) * 1e3:.0f} ms)" if cuts else "no failure")


if __name__ == "__main__":
    main()
