"""Shared pieces of the tests of LoRA adapters over ranks: greedy runs of the parallel tests'
16 prompts on the base and two adapters by turns in one batch, by one process or by ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bf16_rule import Run
from model.parallel.parallel_helpers import margin_runs

from strata.engine.executor import ModelExecutor
from strata.model.config import ModelConfig
from strata.model.executor import TorchExecutor
from strata.model.loader import load_model
from strata.model.lora import LoraAdapter, load_adapter
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import prepare_model

ADAPTERS = ("", "a", "b")  # prompt i runs on ADAPTERS[i % 3] ("": the base)


def adapters(paths: dict[str, Path], config: ModelConfig) -> list[LoraAdapter]:
    return [load_adapter(n, paths[n], config) for n in ("a", "b")]


def runs(executor: ModelExecutor, vocab_size: int, digests: dict[str, str]) -> list[Run]:
    """Greedy runs of `prompts()` in one batch on the base, A and B by turns, with each
    position's top-2 margin."""
    def adapter_of(i: int) -> tuple[str, str]:
        name = ADAPTERS[i % 3]
        return name, digests.get(name, "")

    return margin_runs(executor, vocab_size, adapter_of)


def one_process(paths: dict[str, Path], dtype: str) -> list[Run]:
    loaded = load_model(paths["base"], dtype=dtype)
    executor = TorchExecutor(loaded.config, loaded.weights, dtype=dtype)
    digests = {a.name: executor.add_lora(a) for a in adapters(paths, loaded.config)}
    return runs(executor, loaded.config.vocab_size, digests)


def parallel(paths: dict[str, Path], tensor: int, pipeline: int, dtype: str,
             **options: Any) -> ParallelExecutor:
    prepared = prepare_model(paths["base"], dtype=dtype, cache_dir=None)
    return ParallelExecutor(prepared, ParallelLayout(tensor, pipeline), dtype=dtype,
                            timeout_s=60, **options)


def run_parallel(executor: ParallelExecutor, paths: dict[str, Path]) -> list[Run]:
    digests = {a.name: executor.add_lora(a) for a in adapters(paths, executor.config)}
    return runs(executor, executor.config.vocab_size, digests)
