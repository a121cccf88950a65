"""py-spy profile of the Strata gateway under the hot-path load (bench/gateway_hotpath.py).

    .venv/bin/python bench/profile_gateway.py [--concurrency 64] [--requests 1280] [--out F]

Two simulated instances and one gateway (round_robin); py-spy (`.bench/peers/tools/bin/py-spy`,
installed with `python3 -m venv .bench/peers/tools && .bench/peers/tools/bin/pip install py-spy`)
records the gateway while the load runs; prints self time by function and by library.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import threading
from pathlib import Path

from gateway_overhead import SIM_MODEL, SIM_PROFILE, drive, start_instance, start_path
from procs import stop_all, wait_http

ROOT = Path(__file__).resolve().parent.parent
PYSPY = ROOT / ".bench" / "peers" / "tools" / "bin" / "py-spy"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1280)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--out", default=str(ROOT / ".bench" / "results" / "gateway_pyspy.txt"))
    args = ap.parse_args()
    log_dir = ROOT / ".bench" / "logs" / "profile_gateway"
    instances = [start_instance(f"sim-{i}", log_dir, simulate=SIM_PROFILE, model_name=SIM_MODEL)
                 for i in range(2)]
    procs = list(instances)
    try:
        for p in instances:
            wait_http(p, "/v1/models", 60)
        gw = start_path("strata-round_robin", [p.url for p in instances], log_dir)
        procs.append(gw)
        drive([gw.url], SIM_MODEL, 64, 16, 8)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen([str(PYSPY), "record", "-r", str(args.rate), "--nonblocking",
                                "--format", "raw", "-o", args.out, "-p", str(gw.pid), "-d",
                                str(args.duration)], stdout=subprocess.DEVNULL)
        load = threading.Thread(target=drive, args=([gw.url], SIM_MODEL, args.requests,
                                                    args.concurrency, args.max_tokens))
        load.start()
        spy.wait()
        load.join()
    finally:
        stop_all(procs)
    report(Path(args.out))


def report(path: Path) -> None:
    self_fn: collections.Counter[str] = collections.Counter()
    self_lib: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        leaf = frames[-1]
        self_fn[leaf] += n
        self_lib[_lib(leaf)] += n
        for f in set(frames):
            incl[f] += n
    print(f"{total} samples")
    print("-- self by library")
    for lib, n in self_lib.most_common(15):
        print(f"{100 * n / total:6.1f}%  {lib}")
    print("-- self by function")
    for fn, n in self_fn.most_common(40):
        print(f"{100 * n / total:6.1f}%  {fn}")
    print("-- inclusive")
    for fn, n in incl.most_common(60):
        print(f"{100 * n / total:6.1f}%  {fn}")


def _lib(frame: str) -> str:
    where = frame.rpartition("(")[2]
    for lib in ("strata", "httpcore", "httpx", "h11", "anyio", "starlette", "uvicorn",
                "prometheus_client", "asyncio", "uvloop", "json", "re"):
        if f"/{lib}/" in where or f"{lib}." in where.split("/")[-1]:
            return lib
    return where.split(":")[0].split("/")[-1]


if __name__ == "__main__":
    main()
