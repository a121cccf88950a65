"""The default model (SmolLM2-135M, float32) at T=2, T=3, P=2 and T=2 x P=2 against one process,
on 10 prompts (one of each form; tests/harness/default_parallel.py): greedy continuations
identical, logprobs within 1e-4 until they part, and any that part do so at a near tie of the
one-process run (its top two logprobs within 1e-3). The 50-prompt run, whose count
docs/benchmarks.md gives, is bench/default_model_parallel.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness.default_parallel import CI_PROMPTS, Run, compare, run
from model.parallel.warm_ranks import WarmRankPool
from serve_process import shared_model_cache

from strata.model.executor import TorchExecutor
from strata.model.fetch import resolve_model
from strata.model.loader import load_model
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import PreparedModel, prepare_model

# each layout is minutes on 2 busy cores (the first also runs the one-process reference)
pytestmark = [pytest.mark.network, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def one_process() -> tuple[Path, Run]:
    cache = shared_model_cache()
    path = resolve_model(None, cache_dir=cache, progress=False)
    loaded = load_model(path, dtype="float32", cache_dir=cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs; two OpenMP threads stall on busy cores
    try:
        single = run(TorchExecutor(loaded.config, loaded.weights, dtype="float32"),
                     loaded.config.vocab_size, loaded.tokenizer, CI_PROMPTS)
    finally:
        torch.set_num_threads(threads)
    return path, single


@pytest.fixture(scope="module")
def pool() -> Iterator[WarmRankPool]:
    """Rank processes for every layout (the most one needs: 3 beside rank 0 here), each importing
    torch once, not once per layout."""
    warm = WarmRankPool(3)
    yield warm
    warm.close()


@pytest.fixture(scope="module")
def prepared(one_process: tuple[Path, Run]) -> PreparedModel:
    return prepare_model(one_process[0], dtype="float32", cache_dir=shared_model_cache())


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (3, 1), (1, 2), (2, 2)],
                         ids=["tp2", "tp3", "pp2", "tp2xpp2"])
def test_layouts_match_one_process(pool: WarmRankPool, one_process: tuple[Path, Run],
                                   prepared: PreparedModel, tensor: int, pipeline: int) -> None:
    single = one_process[1]
    layout = ParallelLayout(tensor, pipeline)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rank 0 (this process) on one thread too, as every other rank
    try:
        executor = ParallelExecutor(prepared, layout, dtype="float32", threads=1,
                                    launcher=pool.launcher())
        try:
            split = run(executor, prepared.config.vocab_size, prepared.tokenizer, CI_PROMPTS)
        finally:
            executor.shutdown()
    finally:
        torch.set_num_threads(threads)
    result = compare(single, split, CI_PROMPTS)  # raises where the rule breaks
    print(result.line(layout.name), result.partings)
    assert len({tuple(tokens) for tokens, _ in single}) == len(CI_PROMPTS)  # not degenerate
