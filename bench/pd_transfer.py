"""P/D transfer: what pulling a prompt's KV from a prefill instance costs against recomputing it.

Two `strata serve` processes of the default model (bfloat16, one torch thread each, 2 cores in
all): P and D. For each prompt length L (token ids, fresh each time so no cache helps):

    prefill    P's prefill-only call (compute the prompt, hold its blocks, answer the handle)
    pull       GET {P}/internal/kv/{handle}: the binary block stream, read whole here (bytes and
               wall time; this is what D does, without D's checks and import)
    handoff    D's time to first token with the handle (handshake cached, pull, checks, import,
               P's first token handed over: no prompt token computed on D)
    D's pull   D's own pull, checks included (its strata:pd_pull_seconds), and its transport:
               shm (P's shared-memory pool, pd/shm.py) or http (the stream; P with
               --shm-mb 0 offers no pool)
               The hand-off's whole overhead on D is its handoff time: the pull, the checks,
               the import and the answer's round trip (D computes nothing of the prompt; a
               local prefill would have cost the recompute time instead)
    recompute  D's time to first token without a handle (it prefills the prompt itself)

Medians of --repeats. Writes .bench/results/pd_transfer.json.

    .venv/bin/python bench/pd_transfer.py [--lengths 32 128 512 1024 2048 4096] [--repeats 3]
        [--shm-mb 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, spawn, stop_all, wait_http

from strata.cluster.ports import free_port
from strata.protocol.pd import DECODE_PREFIX, HANDOFF_HEADER, KV_PATH, PREFILL_PREFIX
from strata.protocol.seal import seal

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".bench" / "results" / "pd_transfer.json"
MODEL = "smollm2"
INTERNAL_KEY = "pd-transfer-bench-key"  # the fleet's: the hand-off routes take only it
FLEET = {"authorization": f"Bearer {INTERNAL_KEY}"}


def start(name: str, log_dir: Path, role: str, max_len: int, shm_mb: int = 256) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--role", role,
            "--served-model-name", MODEL, "--model-version", "bench", "--threads", "1",
            "--max-model-len", str(max_len), "--kv-cache-gb", "1.5", "--registry", "none",
            "--log-level", "warning", "--pd-shm-mb", str(shm_mb)]
    proc = spawn(name, argv, log_dir, f"http://127.0.0.1:{port}",
                 env={**os.environ, "STRATA_INTERNAL_KEYS": INTERNAL_KEY})
    wait_http(proc, "/ready", 300)
    return proc


def body_of(tokens: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": tokens, "max_tokens": 1, "temperature": 0,
            "ignore_eos": True}


def one(client: httpx.Client, p: Proc, d: Proc, length: int, rng: random.Random
        ) -> dict[str, float]:
    tokens = [rng.randrange(1000, 40000) for _ in range(length)]
    body = body_of(tokens)
    began = time.perf_counter()
    answer = client.post(f"{p.url}{PREFILL_PREFIX}/v1/completions", json=body, headers=FLEET)
    prefill_s = time.perf_counter() - began
    answer.raise_for_status()
    handle = answer.json()
    began = time.perf_counter()
    with client.stream("GET", f"{p.url}{KV_PATH}/{handle['handle']}", headers=FLEET) as pulled:
        num_bytes = sum(len(chunk) for chunk in pulled.iter_raw())
    pull_s = time.perf_counter() - began
    handle["url"] = p.url  # the blocks are still held: D pulls them again
    sealed = json.dumps(seal(handle, INTERNAL_KEY))  # as the gateway seals it
    pulls_before = d_pulls(client, d)
    began = time.perf_counter()
    handed = client.post(f"{d.url}{DECODE_PREFIX}/v1/completions", json=body,
                         headers=FLEET | {HANDOFF_HEADER: sealed})
    handoff_s = time.perf_counter() - began
    handed.raise_for_status()
    pulls = {k: v - pulls_before[k] for k, v in d_pulls(client, d).items()}
    other = body_of([rng.randrange(1000, 40000) for _ in range(length)])
    began = time.perf_counter()
    client.post(f"{d.url}/v1/completions", json=other, headers=FLEET).raise_for_status()
    recompute_s = time.perf_counter() - began
    return {"prefill_s": prefill_s, "pull_s": pull_s, "bytes": num_bytes,
            "handoff_ttft_s": handoff_s, "d_pull_s": pulls["seconds"],
            "d_shm_pulls": pulls["shm"], "recompute_ttft_s": recompute_s}


def d_pulls(client: httpx.Client, d: Proc) -> dict[str, float]:
    """D's pull counters: seconds pulling (checks included), pulls through P's pool."""
    text = client.get(f"{d.url}/metrics", headers=FLEET).text
    found = {"seconds": 0.0, "shm": 0.0}
    for line in text.splitlines():
        if line.startswith("strata:pd_pull_seconds_sum "):
            found["seconds"] = float(line.split()[-1])
        elif line.startswith('strata:pd_pulls_total{transport="shm"}'):
            found["shm"] = float(line.split()[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[32, 128, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shm-mb", type=int, default=256,
                        help="P's shared-memory pool (0: none, D pulls the HTTP stream)")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="pd-transfer-"))
    procs: list[Proc] = []
    rng = random.Random(0)
    rows = []
    try:
        max_len = max(args.lengths) + 16
        procs = [start("prefill", log_dir, "prefill", max_len, args.shm_mb),
                 start("decode", log_dir, "decode", max_len)]
        p, d = procs
        with httpx.Client(timeout=600) as client:
            one(client, p, d, 32, rng)  # warm up: kernels, the handshake
            for length in args.lengths:
                runs = [one(client, p, d, length, rng) for _ in range(args.repeats)]
                row = {"tokens": length, **{k: statistics.median(r[k] for r in runs)
                                            for k in runs[0]}}
                rows.append(row)
                print(format_row(row), flush=True)
    finally:
        stop_all(procs)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {"load_average": os.getloadavg(), "repeats": args.repeats, "shm_mb": args.shm_mb,
              "rows": rows}
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"load average {os.getloadavg()}; wrote {RESULTS}")


def format_row(row: dict[str, float]) -> str:
    tokens = row["tokens"]
    return (f"{tokens:5d} tokens  {row['bytes'] / 2**20:7.2f} MiB  "
            f"{row['bytes'] / tokens / 1024:5.1f} KiB/token  pull {row['pull_s'] * 1e3:7.1f} ms "
            f"({row['pull_s'] / tokens * 1e6:5.1f} us/token, "
            f"{row['bytes'] / row['pull_s'] / 1e9:4.2f} GB/s)  prefill "
            f"{row['prefill_s'] * 1e3:7.1f} ms  handoff TTFT {row['handoff_ttft_s'] * 1e3:7.1f} "
            f"ms  D's pull {row['d_pull_s'] * 1e3:6.1f} ms "
            f"({row['bytes'] / max(row['d_pull_s'], 1e-9) / 1e9:4.2f} GB/s, "
            f"{'shm' if row['d_shm_pulls'] else 'http'})  "
            f"recompute TTFT {row['recompute_ttft_s'] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
