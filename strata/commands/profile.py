"""`strata profile [MODEL] --out profile.json`: measure the real engine, fit a latency profile.

Prefill steps are timed at several prompt lengths and decode steps at several batch sizes (each
at a short and a long context, so the per-context-token cost can be told apart from the
per-sequence one), all through the real Engine and TorchExecutor with the prefix cache off.
Every configuration runs once unrecorded (first runs of a shape are slow), then `--repeats`
times; the fit (least squares, `strata.sim.profile.fit_profile`) is made to the median time of
each step shape, and the raw points go to the JSON file that `strata serve --simulate` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import random
import statistics
import time
from pathlib import Path
from typing import Any

from strata.clock import Clock
from strata.commands.env import CliEnv
from strata.commands.serve_parallel import serving_device
from strata.engine.executor import ModelInput, ModelOutput
from strata.sim.executor import step_shape
from strata.sim.profile import ProfilePoint, fit_error, fit_profile

PREFILL_LENS = (16, 64, 128, 256, 512)
DECODE_CONTEXTS = (32, 256)
NUM_DECODE_STEPS = 6
BLOCK_SIZE = 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the real engine and fit a latency profile "
                                       "for `strata serve --simulate`")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .gguf file, URI or alias (default: smollm2)")
    p.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    p.add_argument("--weights-dtype", choices=("auto", "bf16", "q8_0", "q4"), default="auto",
                   help="as strata serve's --weights-dtype")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--max-batch", type=int, default=32, help="largest decode batch measured")
    p.add_argument("--repeats", type=int, default=3, help="measurements per configuration")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


class TimingExecutor:
    """Wraps an executor; records every step's shape and wall time."""

    def __init__(self, inner: Any, clock: Clock = time.perf_counter) -> None:
        self.inner = inner
        self.clock = clock
        self.points: list[ProfilePoint] = []

    def kv_bytes_per_token(self) -> int:
        return int(self.inner.kv_bytes_per_token())

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.inner.allocate_kv_cache(num_blocks, block_size)

    def execute(self, model_input: ModelInput) -> ModelOutput:
        start = self.clock()
        output: ModelOutput = self.inner.execute(model_input)
        elapsed_ms = (self.clock() - start) * 1000.0
        shape = step_shape(model_input)
        self.points.append(ProfilePoint(shape.num_prefill_tokens, shape.num_decode_seqs,
                                        shape.num_context_tokens, elapsed_ms))
        return output


def run(args: argparse.Namespace, env: CliEnv) -> int:
    loaded, name = _load(args, env)
    engine, timer = _build_engine(args, loaded)
    rng = random.Random(0)
    workloads = _workloads(args.max_batch)
    for batch, length, max_tokens in workloads:  # warm-up: first runs of a shape are slow
        _generate(engine, [_prompt(rng, loaded, length) for _ in range(batch)], max_tokens)
    timer.points.clear()
    for _ in range(args.repeats):
        for batch, length, max_tokens in workloads:
            _generate(engine, [_prompt(rng, loaded, length) for _ in range(batch)], max_tokens)
    raw = [p for p in timer.points if (p.num_prefill_tokens == 0) != (p.num_decode_seqs == 0)]
    medians = median_points(raw)
    date = datetime.date.today().isoformat()
    profile = fit_profile(medians, model=name, source=f"fitted from {name} on {date} "
                          f"({serving_device(args)}, {args.dtype})",
                          kv_bytes_per_token=timer.kv_bytes_per_token())
    profile = dataclasses.replace(profile, points=tuple(raw))
    profile.save(args.out)
    _report(profile, medians, args.out)
    return 0


def _workloads(max_batch: int) -> list[tuple[int, int, int]]:
    """(batch size, prompt length, max_tokens) of every measured configuration."""
    prefill = [(1, n, 1) for n in PREFILL_LENS]
    decode = [(b, c, 1 + NUM_DECODE_STEPS) for b in _batch_sizes(max_batch)
              for c in DECODE_CONTEXTS]
    return prefill + decode


def median_points(points: list[ProfilePoint]) -> list[ProfilePoint]:
    """One point per step shape, at the median time of its repeats (other processes on the
    machine make single measurements noisy)."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for p in points:
        key = (p.num_prefill_tokens, p.num_decode_seqs, p.num_context_tokens)
        groups.setdefault(key, []).append(p.step_ms)
    return [ProfilePoint(*key, statistics.median(times)) for key, times in sorted(groups.items())]


def _load(args: argparse.Namespace, env: CliEnv) -> tuple[Any, str]:
    from strata.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, resolve_model
    from strata.model.loader import load_model
    from strata.store import is_model_uri, resolve_model_uri

    if args.model is not None and is_model_uri(args.model):
        path = resolve_model_uri(args.model, cache_dir=env.cache_dir)
    else:
        path = resolve_model(args.model, cache_dir=env.cache_dir, progress=True)
    loaded = load_model(path, dtype=args.dtype, cache_dir=env.cache_dir,
                        weights_dtype=args.weights_dtype, device=serving_device(args))
    alias = KNOWN_MODELS.get(args.model or DEFAULT_MODEL)
    return loaded, alias.served_name if alias else loaded.name


def _build_engine(args: argparse.Namespace, loaded: Any) -> tuple[Any, TimingExecutor]:
    import torch

    from strata.engine.config import CacheConfig, SchedulerConfig
    from strata.engine.engine import Engine
    from strata.model.executor import TorchExecutor

    if args.threads:
        torch.set_num_threads(args.threads)
    timer = TimingExecutor(TorchExecutor(loaded.config, loaded.weights, dtype=args.dtype,
                                         device=serving_device(args)))
    max_len = max(*PREFILL_LENS, *DECODE_CONTEXTS) + NUM_DECODE_STEPS + 2
    budget = max(max(PREFILL_LENS), args.max_batch)
    blocks = args.max_batch * -(-(max(DECODE_CONTEXTS) + NUM_DECODE_STEPS + 1) // BLOCK_SIZE)
    engine = Engine(timer, CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks + 64,
                                       enable_prefix_caching=False),
                    SchedulerConfig(max_num_seqs=args.max_batch, max_num_batched_tokens=budget,
                                    max_model_len=max_len, prefill_stretch=0.0),  # exact shapes
                    loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    return engine, timer


def _batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch]
    return [*sizes, max_batch]


def _prompt(rng: random.Random, loaded: Any, length: int) -> list[int]:
    special = set(loaded.config.eos_token_ids) | {loaded.config.bos_token_id}
    ids = [i for i in range(min(loaded.config.vocab_size, 20000)) if i not in special]
    return [rng.choice(ids) for _ in range(length)]


def _generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    from strata.engine.request import Request, SamplingParams
    from strata.types import RequestId

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(RequestId(f"profile-{time.monotonic_ns()}-{i}"), prompt,
                                   params))
    while engine.has_unfinished_requests():
        engine.step()


def _report(profile: Any, points: list[ProfilePoint], out: Path) -> None:
    print(f"{profile.source}: {len(points)} steps measured")
    print(f"  prefill: {profile.prefill_ms_base:.3f} ms + {profile.prefill_ms_per_token:.4f} "
          "ms/token")
    print(f"  decode:  {profile.decode_ms_base:.3f} ms + {profile.decode_ms_per_seq:.4f} ms/seq "
          f"+ {profile.decode_ms_per_context_token:.6f} ms/context token")
    print(f"  fit error (RMS relative): {fit_error(profile, points):.1%}")
    print(f"wrote {out}")
