"""Per-layer attention time of one prefill chunk: the torch paths against the C chunk kernel.

    .venv/bin/python bench/chunk_attention.py

SmolLM2-135M shapes (9 heads, 3 kv heads, head_dim 64), bf16, block size 16, both cores. A chunk
of n tokens starting at position `start` attends to positions 0 .. its own over a scattered
paged cache; the torch path is what the executor ran before the kernel (causal SDPA for a fresh
chunk; gather + two bmm for <= 64 rows, masked SDPA above, for a chunk over a cached context).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.engine.executor import ScheduledSequence  # noqa: E402
from strata.engine.request import SamplingParams  # noqa: E402
from strata.model import attention  # noqa: E402
from strata.model.executor import _prefill_chunk  # noqa: E402
from strata.types import RequestId  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(256, 16), (750, 16), (1484, 16), (1484, 32), (1472, 64), (1400, 128), (1000, 512),
         (0, 16), (0, 64), (0, 128), (0, 512), (0, 2048)]


def per_call_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    torch.set_num_threads(2)
    num_blocks = 256
    k = torch.randn(num_blocks * BLOCK + 1, KV_HEADS, HEAD_DIM).bfloat16()
    v = torch.randn_like(k)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    groups = attention.HeadGroups.of(tuple(range(0, HEADS + 1, HEADS // KV_HEADS)), "cpu")
    print(f"{'start':>6} {'tokens':>6} {'torch us':>9} {'kernel us':>9} {'speed-up':>8}")
    for start, n in CASES:
        blocks = order[: -(-(start + n) // BLOCK)].tolist()
        seq = ScheduledSequence(RequestId("a"), [0] * n, start, blocks, True, SamplingParams(),
                                [], [])
        row = torch.tensor(blocks)
        q = torch.randn(n, HEADS, HEAD_DIM).bfloat16()
        new_kv = torch.randn(2, n, KV_HEADS, HEAD_DIM).bfloat16()
        reps = max(3, 2000 // n)
        times = []
        for use_kernel in (False, True):
            chunk = _prefill_chunk(seq, row, 0, BLOCK, use_kernel)

            def run(c: attention.PrefillChunk = chunk, q: torch.Tensor = q,
                    new: torch.Tensor = new_kv) -> torch.Tensor:
                return attention._prefill_attention(q, new[0], new[1], c, (k, v), BLOCK, groups)

            with torch.inference_mode():
                times.append(per_call_us(run, reps))
        print(f"{start:>6} {n:>6} {times[0]:>9.0f} {times[1]:>9.0f} {times[0] / times[1]:>7.2f}x")


if __name__ == "__main__":
    main()
