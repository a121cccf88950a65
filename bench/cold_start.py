"""Cold start and resident memory of `strata serve` on the default model (issue 30's rows "cold
start ... to ready <= 3 s" and "resident memory at T=1").

Each round starts a fresh `strata serve --port 0` process (the model already on disk: the first
download is not a start), times it from the spawn to its ready line (wall) and keeps the time it
reports itself ("ready in X s"), reads the process tree's resident memory once it is ready
(servers.rss_mib: VmRSS of the server and its children; `--threads 1` keeps one process),
then stops it by PID.
`--weights-dtype` picks the weights (auto: the GGUF's Q4_1 as served; bf16: dequantized at load).

    .venv/bin/python bench/cold_start.py --rounds 5 --weights-dtype auto
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

from servers import rss_mib  # the process and its children, as the peers are measured

READY = re.compile(rb"Strata serving \S+ on http://127\.0\.0\.1:\d+ \(ready in ([0-9.]+)s\)")


def one_start(weights_dtype: str, timeout_s: float) -> dict[str, float]:
    argv = [sys.executable, "-m", "strata.cli", "serve", "--port", "0", "--threads", "1",
            "--weights-dtype", weights_dtype]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        seen = b""
        assert proc.stdout is not None
        while (found := READY.search(seen)) is None:
            line = proc.stdout.readline()
            if not line or time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"no ready line; output:\n{seen.decode(errors='replace')}")
            seen += line
        wall = time.perf_counter() - start
        time.sleep(0.5)  # let the startup's last allocations settle
        return {"wall_s": round(wall, 2), "reported_s": float(found.group(1)),
                "rss_mib": round(rss_mib(proc.pid), 1)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--weights-dtype", choices=["auto", "bf16"], default="auto")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    a = ap.parse_args()
    one_start(a.weights_dtype, a.timeout_s)  # the model fetched and its caches built once
    runs = [one_start(a.weights_dtype, a.timeout_s) for _ in range(a.rounds)]
    summary = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print(json.dumps({"weights_dtype": a.weights_dtype, "runs": runs, "median": summary}))


if __name__ == "__main__":
    main()
