"""Decode attention: the plain kernel against `as_chunk` (each decoded row computed as its
prefill's chunk computes it; keys in the vector lanes for bf16, `cpu_kernels.decodes_keys_in_lanes`)
on SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_dim 64, bf16, 16-token blocks over a
scattered cache four times the sequences' size). The two are timed alternately, best of
`--rounds` rounds of 5 calls each, so that the host's noise falls on both:

    .venv/bin/python bench/decode_attention_speed.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_attention_speed.py   # thread time
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from strata.model import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [(1, 300), (32, 300), (32, 700), (8, 1500)]  # (sequences, cached positions each)


def best_of(rounds: int, fn: list[Callable[[], object]]) -> list[float]:
    best = [float("inf")] * len(fn)
    for _ in range(rounds):
        for i, f in enumerate(fn):
            start = time.perf_counter()
            for _ in range(5):
                f()
            best[i] = min(best[i], (time.perf_counter() - start) / 5)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    assert cpu_kernels.supports(torch.bfloat16, "cpu"), "the C kernels did not build"
    gen = torch.Generator().manual_seed(0)
    lanes = cpu_kernels.decodes_keys_in_lanes(torch.bfloat16, "cpu", HEAD_DIM)
    print(f"keys in the lanes: {lanes}")
    print("| sequences x positions | plain, us | as_chunk, us | ratio |")
    print("|---|---|---|---|")
    for d, length in SHAPES:
        nb = -(-length // BLOCK)
        blocks = d * nb * 4
        k = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        v = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        table = torch.randperm(blocks, generator=gen)[: d * nb].view(d, nb).contiguous()
        lens = torch.full((d,), length, dtype=torch.long)
        q = torch.randn(d, HEADS, HEAD_DIM, generator=gen).bfloat16()
        call = functools.partial(cpu_kernels.decode_attention, q, k, v, table, lens, BLOCK)
        plain, chunk = best_of(args.rounds, [call, functools.partial(call, as_chunk=True)])
        print(f"| {d} x {length} | {plain * 1e6:.0f} | {chunk * 1e6:.0f} | {chunk / plain:.2f} |")


if __name__ == "__main__":
    main()
