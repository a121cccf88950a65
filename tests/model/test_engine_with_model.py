"""Batch invariance of the real engine + TorchExecutor on a tiny random Llama (fp32).

A request must get the same greedy tokens alone, inside a batch of 16 mixed-length requests,
with the prefix cache on or off, with heavy chunking, and when preempted and recomputed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_fakes import run_to_completion
from tiny_models import make_tiny_model_dir

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.types import RequestId

LENGTHS = [3, 17, 40, 5, 64, 1, 33, 9, 12, 28, 50, 2, 7, 19, 44, 30]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("inv") / "m", initializer_range=0.2)
    return load_model(Path(path), dtype="float32")


def make_engine(model: LoadedModel, *, num_blocks: int = 256, budget: int = 256,
                prefix: bool = True, chunked: bool = True) -> Engine:
    executor = TorchExecutor(model.config, model.weights, dtype="float32")
    return Engine(
        executor,
        CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=128,
                        enable_chunked_prefill=chunked),
        model.tokenizer,
        vocab_size=model.config.vocab_size,
    )


def prompt(n: int, shared: int = 0) -> list[int]:
    head = [(11 * i + 5) % 250 for i in range(shared)]
    return head + [(7 * i + 3 * n) % 250 for i in range(n - len(head))]


def request(i: int, tokens: list[int], **params: object) -> Request:
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **params}
    return Request(RequestId(f"q{i}"), tokens, SamplingParams(**options),  # type: ignore[arg-type]
                   arrival_time=float(i))


def run(engine: Engine, prompts: list[list[int]], **params: object) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(request(i, p, **params))
    out = run_to_completion(engine)
    return [out[RequestId(f"q{i}")] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def solo(tiny: LoadedModel) -> list[list[int]]:
    prompts = [prompt(n, shared=min(n - 1, 16)) for n in LENGTHS]
    return [run(make_engine(tiny), [p])[0] for p in prompts]


@pytest.mark.parametrize(
    "options",
    [{}, {"prefix": False}, {"budget": 24}, {"chunked": False}, {"num_blocks": 60}],
    ids=["batched", "no-prefix-cache", "chunked-24", "no-chunking", "preemption"],
)
def test_16_mixed_requests_match_their_solo_runs(
    tiny: LoadedModel, solo: list[list[int]], options: dict
) -> None:
    engine = make_engine(tiny, **options)
    prompts = [prompt(n, shared=min(n - 1, 16)) for n in LENGTHS]
    assert run(engine, prompts) == solo
    assert len({tuple(s) for s in solo}) > 8  # the outputs are not degenerate
    if "num_blocks" in options:
        assert engine.stats().num_preemptions > 0
    if options.get("prefix", True):
        assert engine.stats().prefix_cache_hits > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny: LoadedModel) -> None:
    params = {"temperature": 0.9, "seed": 1234}
    target = prompt(20)
    alone = run(make_engine(tiny), [target], **params)[0]
    engine = make_engine(tiny)
    for i, n in enumerate((4, 33, 9), start=1):
        engine.add_request(request(i, prompt(n)))
    engine.add_request(request(0, target, **params))
    assert run_to_completion(engine)[RequestId("q0")] == alone
    other_seed = run(make_engine(tiny), [target], temperature=0.9, seed=99)[0]
    assert other_seed != alone
