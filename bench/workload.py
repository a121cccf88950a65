"""Prompts shared by every runner (Strata, vLLM, HF): the same token ids for the same seed.

No Strata import here: the vLLM runner imports this module from vLLM's own virtual environment.
"""

from __future__ import annotations

import random


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts drawn from the ordinary vocabulary (ids 100 .. vocab - 100)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]
