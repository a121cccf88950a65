"""Deterministic serving (issue 31): under `strata serve --deterministic`
(`determinism.set_deterministic`) a request's tokens do not depend on what else runs or what is
cached.

Story: issue 31's table as a test, on the tiny llama in every weight format Strata serves (bf16
weights on the C kernels, and a GGUF's Q8_0, Q4_0 and Q4_1 served quantized), greedy and seeded
(T 0.9, top_p 0.95). Six prompts are each run alone on a fresh engine; then each must give the
very same tokens
  - again on that engine, its prefix now cached;
  - inside concurrent batches of 6, 20 and 40 requests;
  - prefilled in chunks of 8 and 20 tokens (the step budget);
  - greedy, prefilled again with its first 5 tokens appended to its prompt: what a resumed
    stream, a prefill/decode hand-off or a session moved to another instance recomputes.
By default an AMX CPU runs quantized weights on the vector kernel under 8 rows and on the AMX
tiles from 8, which round differently, so these comparisons part there
(docs/benchmarks.md, "Determinism"); the switch runs one kernel at every row count.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from engine_fakes import run_to_completion
from model.built_kernels import require_kernels
from required import require
from tiny_models import make_tiny_model_dir, write_tiny_gguf

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.determinism import deterministic_by_default, set_deterministic
from strata.model.executor import TorchExecutor
from strata.model.gemm import PackedWeight
from strata.model.loader import LoadedModel, load_model
from strata.model.quant import quantize
from strata.types import RequestId

FORMATS = ["bf16", "Q8_0", "Q4_0", "Q4_1"]
LENGTHS = (9, 23, 31, 40, 17, 50)
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
RESUMED_AFTER = 5
_IDS = itertools.count()


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.95, seed=1000 + i,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny", seed=3)


@pytest.fixture
def one_kernel() -> Iterator[None]:
    set_deterministic(True)
    try:
        yield
    finally:
        set_deterministic(False)


def model_of(fmt: str, tiny_dir: Path, tmp_path: Path) -> LoadedModel:
    require_kernels()
    if fmt == "bf16":
        require("avx512_bf16")  # else bf16 weights run oneDNN, whose kernel choice is its own
        return load_model(tiny_dir, dtype="bfloat16")
    path = write_tiny_gguf(tiny_dir, tmp_path / f"{fmt}.gguf", gguf.GGMLQuantizationType[fmt])
    return load_model(path, dtype="bfloat16", weights_dtype="auto")


def engine_of(model: LoadedModel, budget: int = 256) -> Engine:
    executor = TorchExecutor(model.config, dict(model.weights), dtype="bfloat16")
    assert isinstance(executor.model.layers[0].gate_up, PackedWeight)  # the C kernels run
    return Engine(executor,
                  CacheConfig(block_size=4, num_blocks=1024, enable_prefix_caching=True),
                  SchedulerConfig(max_num_seqs=min(64, budget), max_num_batched_tokens=budget,
                                  max_model_len=128, enable_chunked_prefill=True),
                  model.tokenizer, vocab_size=model.config.vocab_size)


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(LENGTHS[i % len(LENGTHS)])]
            for i in range(n)]


def run(engine: Engine, batch: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """All of `batch` in flight at once; each request's tokens, in order."""
    tag = next(_IDS)
    for i, (prompt, params) in enumerate(batch):
        engine.add_request(Request(RequestId(f"{tag}-{i}"), list(prompt), params))
    out = run_to_completion(engine)
    return [out[RequestId(f"{tag}-{i}")] for i in range(len(batch))]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_requests_tokens_do_not_depend_on_its_batch_cache_or_chunks(
        fmt: str, tiny_dir: Path, tmp_path: Path, one_kernel: None) -> None:
    model = model_of(fmt, tiny_dir, tmp_path)
    vocab = model.config.vocab_size
    mine = prompts(vocab, len(LENGTHS), seed=1)
    for name, params in (("greedy", [GREEDY] * len(mine)),
                         ("seeded", [seeded(i) for i in range(len(mine))])):
        engine = engine_of(model)
        alone = [run(engine, [(p, params[i])])[0] for i, p in enumerate(mine)]
        assert len({tuple(t) for t in alone}) > 1, "the prompts must give different answers"
        cached = [run(engine, [(p, params[i])])[0] for i, p in enumerate(mine)]
        assert cached == alone, f"{fmt} {name}: with its prefix cached"
        for size in (6, 20, 40):
            others = prompts(vocab, size - len(mine), seed=size)
            batch = [*zip(mine, params, strict=True), *((p, GREEDY) for p in others)]
            got = run(engine_of(model), batch)[:len(mine)]
            assert got == alone, f"{fmt} {name}: inside a batch of {size}"
        for budget in (8, 20):
            chunked = [run(engine_of(model, budget), [(p, params[i])])[0]
                       for i, p in enumerate(mine)]
            assert chunked == alone, f"{fmt} {name}: prefilled in chunks of {budget}"
        if name == "greedy":
            again = SamplingParams(max_tokens=NEW - RESUMED_AFTER, temperature=0.0,
                                   ignore_eos=True)
            resumed = run(engine_of(model), [(p + t[:RESUMED_AFTER], again)
                                             for p, t in zip(mine, alone, strict=True)])
            assert resumed == [t[RESUMED_AFTER:] for t in alone], \
                f"{fmt}: prompt and first tokens prefilled again"


def test_quantized_weights_are_deterministic_by_default_and_bf16_ones_are_not() -> None:
    """`strata serve`'s default (no --deterministic / --no-deterministic): on exactly when a
    weight is served quantized, where a busy instance runs the same kernels either way, and the
    decode attention pays nothing for computing a decoded row as a prefill does."""
    q8 = quantize(torch.randn(32, 64), "q8_0")
    quantized = {"a.weight": torch.zeros(2), "b.weight": q8}
    assert deterministic_by_default(quantized, free_attention=True)
    assert not deterministic_by_default(quantized, free_attention=False)  # no AVX512-BF16
    bf16 = {"a.weight": torch.zeros(2, dtype=torch.bfloat16)}
    assert not deterministic_by_default(bf16, free_attention=True)
    assert not deterministic_by_default({}, free_attention=True)  # ranks read bf16 slices
