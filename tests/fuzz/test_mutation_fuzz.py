"""The short mutation-fuzz run of CI (the long one is bench/fuzz.py): hostile bodies to a real
instance and a real gateway get a 2xx or a 4xx with an OpenAI error body; no 5xx, reset or hang."""

from __future__ import annotations

import asyncio

import pytest
from harness.fuzz import run_fuzz
from harness.mutations import KINDS, Mutator
from sim_stack import MODEL, Targets

NUM_MUTANTS = 400  # about 2 s per target here; every kind 50 times


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_mutated_bodies_get_answers_never_5xx_resets_or_hangs(targets: Targets,
                                                              target: str) -> None:
    mutants = list(Mutator(seed=20261215, model_name=MODEL).mutants(NUM_MUTANTS))
    assert {m.kind for m in mutants} == set(KINDS)
    report = asyncio.run(run_fuzz(targets.urls[target], mutants, timeout_s=15.0))
    assert report.findings == []
    assert report.num_sent == NUM_MUTANTS
    assert report.counts["refused"] > NUM_MUTANTS // 2  # most mutants are refused ...
    assert report.counts["ok"] > 0  # ... and some are still valid requests, answered
