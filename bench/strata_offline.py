"""Offline Strata: build an Engine on a model and drive `engine.step()` over a workload.

Usage (one measurement, JSON on stdout):
    .venv/bin/python bench/strata_offline.py --workload fixed --num 32 --input-len 128 \
        --output-len 64 [--model DIR|FILE] [--threads 2] [--no-prefix-cache]

Workloads: `fixed` (N x L_in x L_out, ignore_eos), `single` (one request, L_out tokens),
`prefix` (shared 1,000-token system prompt + unique suffixes, one request at a time, TTFT),
`unique` (as `prefix` but every prompt unique), `interference` (a long prompt arriving while
N streams decode; per-token ITL of the decoding streams).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_workload_args, random_prompts  # noqa: E402

from strata.bench.report import percentile  # noqa: E402
from strata.engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.model.executor import TorchExecutor  # noqa: E402
from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import LoadedModel, load_model  # noqa: E402
from strata.types import RequestId  # noqa: E402

CACHE_DIR = Path("/tmp/strata-cache")


def load(model: str | None) -> LoadedModel:
    path = resolve_model(model, cache_dir=CACHE_DIR, progress=False)
    return load_model(path, dtype="bfloat16", cache_dir=CACHE_DIR)


def build_engine(loaded: LoadedModel, *, prefix_cache: bool = True, chunked: bool = True,
                 max_num_batched_tokens: int = 512, kv_gb: float = 1.0,
                 max_num_seqs: int = 64, prefill_stretch: float | None = None,
                 max_loras: int | None = None) -> Engine:
    """`prefill_stretch` None: SchedulerConfig's default; `max_loras` None: no limit of
    adapters per step."""
    executor = TorchExecutor(loaded.config, loaded.weights, dtype="bfloat16")
    num_blocks = CacheConfig.blocks_for_gb(kv_gb, executor.kv_bytes_per_token(), 16)
    cache = CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix_cache)
    budget = max_num_batched_tokens if chunked else 2048
    stretch = {} if prefill_stretch is None else {"prefill_stretch": prefill_stretch}
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=2048, enable_chunked_prefill=chunked,
                            max_loras=max_loras, **stretch)
    return Engine(executor, cache, sched, loaded.tokenizer, vocab_size=loaded.config.vocab_size)


_counter = 0


def make_request(prompt: list[int], max_tokens: int) -> Request:
    global _counter
    _counter += 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(RequestId(f"b{_counter}"), list(prompt), params, arrival_time=time.monotonic())


@dataclass
class Timeline:
    """Arrival and per-token times of each request."""

    arrival: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)

    def ttft(self, rid: str) -> float:
        return self.tokens[rid][0] - self.arrival[rid]

    def itls(self, rid: str) -> list[float]:
        t = self.tokens[rid]
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def run(engine: Engine, requests: list[Request], tl: Timeline | None = None) -> Timeline:
    """Add `requests` and step until every request finished."""
    tl = tl or Timeline()
    for r in requests:
        tl.arrival[r.request_id] = time.perf_counter()
        engine.add_request(r)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            tl.tokens.setdefault(o.request_id, []).append(now)
    return tl


BF16_GEMM_GFLOPS = 400.0  # BENCHMARKS.md's machine ceiling (bf16 GEMM, both cores)
MEMORY_GB_S = 30.0


def fixed(engine: Engine, n: int, lin: int, lout: int, vocab: int, seed: int = 0) -> dict:
    """N prompts at once, greedy, ignore_eos; output tokens per second of the whole run."""
    prompts = random_prompts(n, lin, vocab, seed)
    t0 = time.perf_counter()
    tl = run(engine, [make_request(p, lout) for p in prompts])
    dt = time.perf_counter() - t0
    total = sum(len(v) for v in tl.tokens.values())
    assert total == n * lout, (total, n * lout)
    res = {"output_tokens": total, "seconds": dt, "tokens_per_s": total / dt}
    if n == 1:  # single stream: decode rate after the first token, against memory bandwidth
        times = next(iter(tl.tokens.values()))
        res["decode_tokens_per_s"] = (len(times) - 1) / (times[-1] - times[0])
    return res


def model_flops(loaded: LoadedModel) -> tuple[float, float]:
    """(FLOPs per prompt token, FLOPs per sampled token): 2 x parameters used, no attention."""
    numel = sum(w.numel() for w in loaded.weights.values())
    embed = loaded.weights["model.embed_tokens.weight"].numel()
    return 2.0 * (numel - embed), 2.0 * numel  # a prompt token skips the lm_head


def ceilings(res: dict, loaded: LoadedModel, n: int, lin: int, lout: int) -> dict:
    """The run as a fraction of the bf16 compute ceiling (throughput) or of memory bandwidth."""
    per_prompt, per_sampled = model_flops(loaded)
    if n == 1:
        weight_bytes = sum(w.numel() * w.element_size() for w in loaded.weights.values())
        ceiling = MEMORY_GB_S * 1e9 / weight_bytes
        return {"weight_mb": weight_bytes / 1e6, "bandwidth_ceiling_tokens_per_s": ceiling,
                "fraction_of_bandwidth_ceiling": res["decode_tokens_per_s"] / ceiling}
    flops = n * (lin * per_prompt + lout * per_sampled)
    gflops = flops / res["seconds"] / 1e9
    return {"gflops": gflops, "fraction_of_bf16_ceiling": gflops / BF16_GEMM_GFLOPS}


def prefix(engine: Engine, n: int, shared: bool, vocab: int, seed: int = 0) -> dict:
    """One request at a time (max_tokens 1): TTFT of a 1,000 + 100 token prompt."""
    system = random_prompts(1, 1000, vocab, seed)[0]
    suffixes = random_prompts(n + 1, 100, vocab, seed + 1)
    ttfts = []
    t0 = time.perf_counter()
    for i, suffix in enumerate(suffixes):
        head = system if shared else random_prompts(1, 1000, vocab, seed + 100 + i)[0]
        r = make_request(head + suffix, 1)
        tl = run(engine, [r])
        if i > 0:  # the first request warms the cache
            ttfts.append(tl.ttft(r.request_id))
    dt = time.perf_counter() - t0
    return {"ttft_p50": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
            "prompt_tokens_per_s": (n + 1) * 1100 / dt}


def interference(engine: Engine, streams: int, long_len: int, vocab: int) -> dict:
    """`streams` requests decode; after 16 steps a `long_len` prompt arrives."""
    prompts = random_prompts(streams, 64, vocab, 3)
    reqs = [make_request(p, 256) for p in prompts]
    tl = Timeline()
    for r in reqs:
        tl.arrival[r.request_id] = time.perf_counter()
        engine.add_request(r)
    steps = 0
    t0 = time.perf_counter()
    big = make_request(random_prompts(1, long_len, vocab, 4)[0], 8)
    while engine.has_unfinished_requests():
        if steps == 24:
            tl.arrival[big.request_id] = time.perf_counter()
            engine.add_request(big)
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            tl.tokens.setdefault(o.request_id, []).append(now)
    itls = sorted(x for r in reqs for x in tl.itls(r.request_id))
    return {"itl_p50": _pct(itls, 50), "itl_p99": _pct(itls, 99), "itl_max": itls[-1],
            "p99_over_p50": _pct(itls, 99) / _pct(itls, 50),
            "max_over_p50": itls[-1] / _pct(itls, 50),
            "long_prompt_ttft": tl.ttft(big.request_id),
            "tokens_per_s": sum(map(len, tl.tokens.values())) / (time.perf_counter() - t0)}


def _pct(xs: list[float], p: float) -> float:
    return percentile(xs, p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="fixed",
                    choices=["fixed", "single", "prefix", "unique", "interference"])
    add_workload_args(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-chunked-prefill", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--prefill-stretch", type=float, default=None,
                    help="SchedulerConfig.prefill_stretch (default: the engine's)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(a.model)
    vocab = loaded.config.vocab_size
    engine = build_engine(loaded, prefix_cache=not a.no_prefix_cache,
                          chunked=not a.no_chunked_prefill, max_num_batched_tokens=a.budget,
                          max_num_seqs=min(64, a.budget), prefill_stretch=a.prefill_stretch)
    for _ in range(a.warmup):
        fixed(engine, 4, 32, 8, vocab, seed=99)
    engine.reset_prefix_cache()
    for i in range(a.repeats - 1):
        print(json.dumps(fixed(engine, a.num, a.input_len, a.output_len, vocab, seed=i + 1)))
    if a.workload in ("fixed", "single"):
        n = a.num if a.workload == "fixed" else 1
        res = fixed(engine, n, a.input_len, a.output_len, vocab)
        res |= ceilings(res, loaded, n, a.input_len, a.output_len)
    elif a.workload in ("prefix", "unique"):
        res = prefix(engine, a.num, a.workload == "prefix", vocab)
    else:
        res = interference(engine, a.num, a.input_len, vocab)
    res |= {"workload": a.workload, "threads": a.threads, "prefix_cache": not a.no_prefix_cache,
            "chunked_prefill": not a.no_chunked_prefill}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
