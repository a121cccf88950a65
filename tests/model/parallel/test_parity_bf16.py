"""T=2 and P=2 against one process in the default dtype (bf16): each layout's greedy tokens
equal T=1's until they part, and part only at a near tie of T=1 (tests/bf16_rule.py, the margin
rule of the model tests). Float32 identity is tests/model/parallel/test_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from bf16_rule import Run, assert_bf16_agrees, parting
from model.built_kernels import require_kernels
from model.parallel.parallel_helpers import MAX_TOKENS, margin_runs
from required import require

from strata.model.determinism import set_deterministic
from strata.model.executor import TorchExecutor
from strata.model.loader import load_model
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import prepare_model

pytestmark = pytest.mark.needs("shm")
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def one_process(model_dir: Path) -> list[Run]:
    loaded = load_model(model_dir, dtype=DTYPE)
    executor = TorchExecutor(loaded.config, loaded.weights, dtype=DTYPE)
    return margin_runs(executor, loaded.config.vocab_size)


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_layout_in_bf16_parts_from_one_process_only_at_near_ties(
        model_dir: Path, one_process: list[Run], tensor: int, pipeline: int) -> None:
    prepared = prepare_model(model_dir, dtype=DTYPE, cache_dir=None)
    executor = ParallelExecutor(prepared, ParallelLayout(tensor, pipeline), dtype=DTYPE,
                                timeout_s=60)
    try:
        got = margin_runs(executor, prepared.config.vocab_size)
    finally:
        executor.shutdown()
    for i, (want, run) in enumerate(zip(one_process, got, strict=True)):
        assert_bf16_agrees(want, run, f"prompt {i}")
    same = sum(parting(want, run) is None for want, run in zip(one_process, got, strict=True))
    print(f"T={tensor} P={pipeline} bf16: {same}/{len(got)} identical over {MAX_TOKENS} tokens")
    assert same >= len(got) // 2  # the rule allows a parting at a tie; most do not part


def test_pipeline_stages_under_the_switch_give_one_process_s_very_tokens_and_logprobs(
        model_dir: Path) -> None:
    """Deterministic (issue 31), a pipeline stage runs each layer whole on the kernels one
    process runs, whatever its batch (two batches are in flight across the stages), and the
    activations cross between stages as the bf16 they are: P=2 is T=1 to the bit. (T=2 cannot
    be: each rank rounds its partial sum of a row-parallel product before the all-reduce.)"""
    require_kernels()
    require("avx512_bf16")  # else bf16 weights run oneDNN, whose kernel choice is its own
    set_deterministic(True)  # the ranks copy it when they start (RankSpec)
    try:
        loaded = load_model(model_dir, dtype=DTYPE)
        want = margin_runs(TorchExecutor(loaded.config, loaded.weights, dtype=DTYPE),
                           loaded.config.vocab_size)
        prepared = prepare_model(model_dir, dtype=DTYPE, cache_dir=None)
        executor = ParallelExecutor(prepared, ParallelLayout(1, 2), dtype=DTYPE, timeout_s=60)
        try:
            got = margin_runs(executor, prepared.config.vocab_size)
        finally:
            executor.shutdown()
    finally:
        set_deterministic(False)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
