"""Prompts shared by every runner (Strata, vLLM, HF): the same token ids for the same seed.

No Strata import here: the vLLM runner imports this module from vLLM's own virtual environment.
"""

from __future__ import annotations

import argparse
import random

# The fixed workload every runner measures: 32 prompts x 128 tokens in, 64 tokens out.
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 32, 128, 64


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts drawn from the ordinary vocabulary (ids 100 .. vocab - 100)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """--num, --input-len, --output-len, defaulting to the fixed workload."""
    ap.add_argument("--num", type=int, default=NUM_PROMPTS)
    ap.add_argument("--input-len", type=int, default=INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
