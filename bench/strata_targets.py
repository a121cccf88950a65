"""Strata's own targets, each A/B pair interleaved and repeated; medians printed.

    .venv/bin/python bench/strata_targets.py [--rounds 3] [--only single,prefix,...]

single:        one request, 16 prompt tokens, 256 output tokens: decode tokens/s and the fraction
               of the memory-bandwidth ceiling (weight bytes per step / 30 GB/s)
prefix:        1,000-token shared system prompt + 100-token unique suffixes: TTFT p50, cache on/off
unique:        the same prompts but all unique: prompt tokens/s, cache on/off (cost of the cache)
interference:  a 1,500-token prompt arriving while 16 streams decode: ITL p50/p99, chunked
               prefill (32-token step budget: 16 decode rows + 16-token chunks) against
               no chunking (decode streams run 256 tokens so that p50 is a plain decode step)
startup:       `strata serve` (default model, cached) until /v1/models answers; resident memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from servers import ROOT, fixed_load, rss_mib, start_strata

OFFLINE = [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "bench" / "strata_offline.py")]
PAIRS: dict[str, list[tuple[str, list[str]]]] = {
    "single": [("single", ["--workload", "single", "--input-len", "16", "--output-len", "256"])],
    "prefix": [("cache on", ["--workload", "prefix", "--num", "10"]),
               ("cache off", ["--workload", "prefix", "--num", "10", "--no-prefix-cache"])],
    "unique": [("cache on", ["--workload", "unique", "--num", "10"]),
               ("cache off", ["--workload", "unique", "--num", "10", "--no-prefix-cache"])],
    "interference": [
        ("chunked", ["--workload", "interference", "--num", "16", "--input-len", "1500",
                     "--budget", "32"]),
        ("unchunked", ["--workload", "interference", "--num", "16", "--input-len", "1500",
                       "--no-chunked-prefill"])],
}
KEYS = {"single": ["decode_tokens_per_s", "fraction_of_bandwidth_ceiling"],
        "prefix": ["ttft_p50"], "unique": ["prompt_tokens_per_s"],
        "interference": ["itl_p50", "itl_p99", "p99_over_p50", "itl_max", "max_over_p50",
                         "long_prompt_ttft"]}


def offline(args: list[str]) -> dict:
    out = subprocess.run(OFFLINE + args, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def startup_round(port: int) -> dict:
    server = start_strata(None, port=port)
    try:
        idle = rss_mib(server.pid)
        fixed_load(server.url)
        return {"ready_s": server.ready_s, "rss_idle_mib": idle,
                "rss_after_load_mib": rss_mib(server.pid)}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="single,prefix,unique,interference,startup")
    a = ap.parse_args()
    results: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for target in a.only.split(","):
            if target == "startup":
                results.setdefault("startup", []).append(startup_round(8400 + r))
                continue
            for label, args in PAIRS[target]:
                res = offline(args)
                results.setdefault(f"{target}/{label}", []).append(
                    {k: res[k] for k in KEYS[target]})
        print(json.dumps({k: v[-1] for k, v in results.items()}), flush=True)
    for name, runs in results.items():
        med = {k: round(statistics.median(x[k] for x in runs), 4) for k in runs[0]}
        spread = {k: [round(min(x[k] for x in runs), 4), round(max(x[k] for x in runs), 4)]
                  for k in runs[0]}
        print(f"{name:>24}: median {med}  min/max {spread}")


if __name__ == "__main__":
    Path(ROOT / ".bench").mkdir(exist_ok=True)
    main()
