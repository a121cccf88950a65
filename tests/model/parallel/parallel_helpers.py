"""Shared pieces of the parallel-model tests: the tiny 9-head model, engines over an executor,
greedy runs that keep tokens and logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bf16_rule import Run
from tiny_models import make_tiny_model_dir

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelExecutor
from strata.engine.request import Request, SamplingParams
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import PreparedModel
from strata.types import RequestId

if TYPE_CHECKING:
    from strata.model.parallel.executor import ParallelExecutor

# 9 query heads over 3 KV heads, as SmolLM2: T=2 splits them 5 + 4 around a shared KV head.
NINE_HEADS = {"hidden_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 128, "num_hidden_layers": 2, "initializer_range": 0.2}
LENGTHS = [3, 17, 40, 5, 64, 1, 33, 9, 12, 28, 50, 2, 7, 19, 44, 30]
MAX_TOKENS = 10


def make_nine_head_model(path: Path, **overrides: Any) -> Path:
    return make_tiny_model_dir(path, **(NINE_HEADS | overrides))


def prompt(n: int, shared: int = 0) -> list[int]:
    head = [(11 * i + 5) % 250 for i in range(shared)]
    return head + [(7 * i + 3 * n) % 250 for i in range(n - len(head))]


def prompts() -> list[list[int]]:
    return [prompt(n, shared=min(n - 1, 16)) for n in LENGTHS]


def make_engine(executor: ModelExecutor, vocab_size: int, *, num_blocks: int = 256,
                budget: int = 256) -> Engine:
    return Engine(executor,
                  CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=True),
                  SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                                  max_model_len=128, enable_chunked_prefill=True),
                  _Decoder(), vocab_size=vocab_size)


class _Decoder:
    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]


def run_greedy(engine: Engine, batch: list[list[int]], first_id: int = 0,
               in_flight: list[int] | None = None) -> list[Greedy]:
    """Greedy (ignore_eos) runs of `batch`, all added at once; results in order. `in_flight`
    gets the batches still in flight after each step (1 means two were in flight at once)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    ids = [RequestId(f"q{first_id + i}") for i in range(len(batch))]
    for i, (rid, p) in enumerate(zip(ids, batch, strict=True)):
        engine.add_request(Request(rid, list(p), params, arrival_time=float(i)))
    results = {rid: Greedy([], []) for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id].tokens += out.new_token_ids
            results[out.request_id].logprobs += [lp.logprob for lp in out.new_logprobs]
        engine.check_integrity()
        if in_flight is not None:
            in_flight.append(engine.stats().num_batches_in_flight)
    return [results[rid] for rid in ids]


def one_process_reference(model_dir: Path) -> list[Greedy]:
    """The greedy runs of `prompts()` by one process (T = P = 1), float32."""
    from strata.model.executor import TorchExecutor
    from strata.model.loader import load_model

    loaded = load_model(model_dir, dtype="float32")
    executor = TorchExecutor(loaded.config, loaded.weights, dtype="float32")
    return run_greedy(make_engine(executor, loaded.config.vocab_size), prompts())


def assert_same(got: list[Greedy], want: list[Greedy]) -> None:
    """Identical tokens, logprobs within 1e-4."""
    assert [g.tokens for g in got] == [w.tokens for w in want]
    for g, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4


def parallel_executor(model: PreparedModel, tensor: int, pipeline: int = 1,
                      **options: Any) -> ParallelExecutor:
    from strata.model.parallel.executor import ParallelExecutor

    layout = ParallelLayout(tensor_size=tensor, pipeline_size=pipeline)
    return ParallelExecutor(model, layout, dtype="float32", timeout_s=60, **options)


def rank_processes(pid: int) -> list[int]:
    """Pids of the rank processes `pid` spawned (multiprocessing's resource tracker aside)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == pid and b"spawn_main" in cmdline:
            found.append(int(proc.name))
    return sorted(found)


def margin_runs(executor: ModelExecutor, vocab_size: int,
                adapter_of: Callable[[int], tuple[str, str]] | None = None) -> list[Run]:
    """Greedy runs of `prompts()` in one batch with each position's top-2 margin (the bf16
    rule's inputs); prompt i on the adapter `adapter_of(i)` gives, (name, digest), if any."""
    engine: Engine = make_engine(executor, vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    batch = prompts()
    for i, p in enumerate(batch):
        name, digest = adapter_of(i) if adapter_of is not None else ("", "")
        engine.add_request(Request(RequestId(f"r{i}"), list(p), params, arrival_time=float(i),
                                   lora_name=name, lora_digest=digest))
    found = {f"r{i}": Run([], [], []) for i in range(len(batch))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            run = found[out.request_id]
            run.tokens.extend(out.new_token_ids)
            for lp in out.new_logprobs:
                run.logprobs.append(lp.logprob)
                run.margins.append(lp.top[0][1] - lp.top[1][1])
        engine.check_integrity()
    return [found[f"r{i}"] for i in range(len(batch))]
