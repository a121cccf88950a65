"""Tensor parallel on one host: what the collectives cost, what T ranks buy on the fixed workload.

Usage (JSON lines on stdout; `table` turns them into the markdown of docs/benchmarks.md):
    .venv/bin/python bench/parallel.py allreduce [--iters 2000]
    .venv/bin/python bench/parallel.py workload --tp 1 --threads 2
    .venv/bin/python bench/parallel.py workload --tp 2 --threads 1
    .venv/bin/python bench/parallel.py workload --tp 3 --threads 1
    .venv/bin/python bench/parallel.py workload --pp 2 --threads 1
    .venv/bin/python bench/parallel.py table results.jsonl

Not run in CI (minutes on the default model); docs/benchmarks.md has the numbers and commands.

allreduce: p50/p99 latency of one all_reduce between two processes, shared memory against gloo
(TCP on 127.0.0.1), for 576 floats (one decode row of SmolLM2) and 32 x 576 (a batch).

workload: the Stage 1 fixed workload (bench/workload.py: 32 prompts x 128 tokens in, 64 out,
bf16, greedy) on SmolLM2 through the real Engine, one process or T x P ranks (P batches in
flight). Reports output tok/s overall and in the decode window; time to first token (of the
batch, and of one prompt alone); time per output token; a decode round (one token for every
sequence) split into communication (rank 0's time inside collectives, waiting for slower ranks
included), compute (the rest of the executor's time: forward, sampling, waiting for later
stages) and Python (the engine around the executor); stage busy fractions; RSS and weight bytes
per rank; bytes and encode time of the step broadcast.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_workload_args, random_prompts  # noqa: E402

from strata.engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.executor import BatchHandle, ModelInput, ModelOutput  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.model.fetch import resolve_model  # noqa: E402
from strata.types import RequestId  # noqa: E402

CACHE_DIR = Path.home() / ".cache" / "strata"
SIZES = {"576": (576,), "32x576": (32, 576)}


# --- all-reduce latency ---------------------------------------------------------------------------

def _reduce_rank(backend: str, rank: int, name: str, init: str, iters: int, out: Any) -> None:
    torch.set_num_threads(1)
    if backend == "shm":
        from strata.model.parallel.shm import ShmGroup

        group: Any = ShmGroup.attach(name, rank, 2, timeout_s=60)
        reduce = group.all_reduce
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        reduce = dist.all_reduce
    result = {}
    for label, shape in SIZES.items():
        x = torch.randn(shape)
        for _ in range(100):
            reduce(x)
        samples = []
        for _ in range(iters):
            start = time.perf_counter_ns()
            reduce(x)
            samples.append((time.perf_counter_ns() - start) / 1e3)
        samples.sort()
        result[label] = {"p50_us": samples[len(samples) // 2],
                         "p99_us": samples[int(len(samples) * 0.99)]}
    if rank == 0:
        out.put(result)


def allreduce(iters: int) -> list[dict]:
    from strata.model.parallel.shm import ShmGroup, new_segment_prefix

    ctx = mp.get_context("spawn")
    rows = []
    for backend in ("shm", "gloo"):
        name = new_segment_prefix() + "-bench"
        if backend == "shm":
            ShmGroup.create(name, 2)
        init = f"tcp://127.0.0.1:{_free_port()}"
        queue = ctx.Queue()
        procs = [ctx.Process(target=_reduce_rank, args=(backend, r, name, init, iters, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join(60)
        ShmGroup.unlink(name)
        rows += [{"bench": "allreduce", "backend": backend, "size": label, **stats}
                 for label, stats in result.items()]
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the fixed workload ---------------------------------------------------------------------------

class TimedExecutor:
    """Times the wrapped executor (and rank 0's collectives inside it) as the engine drives it:
    `submit`/`collect` for a pipeline (P batches in flight), `execute` behind them otherwise.
    `exec_s` and `comm_s` add up until `take()` reads and clears them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.exec_s = 0.0
        self.comm_s = 0.0
        self.pickle_samples: list[tuple[int, float]] = []  # (bytes, seconds) of a whole input
        self._async = hasattr(inner, "submit")
        self._outputs: dict[int, ModelOutput] = {}
        self._next = 0

    @property
    def max_concurrent_batches(self) -> int:
        return int(getattr(self.inner, "max_concurrent_batches", 1))

    def kv_bytes_per_token(self) -> int:
        return int(self.inner.kv_bytes_per_token())

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.inner.allocate_kv_cache(num_blocks, block_size)

    def submit(self, model_input: ModelInput) -> BatchHandle:
        """Also pickles the whole input once, untimed: what sending it to each rank would cost."""
        start = time.perf_counter()
        size = len(pickle.dumps(model_input, pickle.HIGHEST_PROTOCOL))
        self.pickle_samples.append((size, time.perf_counter() - start))
        if self._async:
            return self._timed(lambda: self.inner.submit(model_input))  # type: ignore[no-any-return]
        self._next += 1
        self._outputs[self._next] = self._timed(lambda: self.inner.execute(model_input))
        return BatchHandle(self._next)

    def collect(self, handle: BatchHandle) -> ModelOutput:
        if self._async:
            return self._timed(lambda: self.inner.collect(handle))  # type: ignore[no-any-return]
        return self._outputs.pop(int(handle))

    def execute(self, model_input: ModelInput) -> ModelOutput:
        return self.collect(self.submit(model_input))

    def take(self) -> tuple[float, float]:
        spent = (self.exec_s, self.comm_s)
        self.exec_s = self.comm_s = 0.0
        return spent

    def _timed(self, call: Callable[[], Any]) -> Any:
        comm = self._comm()
        start = time.perf_counter()
        result = call()
        self.exec_s += time.perf_counter() - start
        self.comm_s += self._comm() - comm
        return result

    def _comm(self) -> float:
        return float(self.inner.comm_seconds()) if hasattr(self.inner, "comm_seconds") else 0.0


def build(tp: int, pp: int, threads: int, dtype: str) -> tuple[Any, Any, int]:
    """(executor, tokenizer, vocab) for one process or `tp` x `pp` ranks."""
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    torch.set_num_threads(threads)
    if tp * pp == 1:
        from strata.model.executor import TorchExecutor
        from strata.model.loader import load_model

        loaded = load_model(path, dtype=dtype, cache_dir=CACHE_DIR)
        executor: Any = TorchExecutor(loaded.config, loaded.weights, dtype=dtype)
        loaded.weights.clear()
        return executor, loaded.tokenizer, loaded.config.vocab_size
    from strata.model.parallel.executor import ParallelExecutor
    from strata.model.parallel.layout import ParallelLayout
    from strata.model.parallel.shard_loader import prepare_model

    prepared = prepare_model(path, dtype=dtype, cache_dir=CACHE_DIR)
    executor = ParallelExecutor(prepared, ParallelLayout(tp, pp), dtype=dtype, threads=threads)
    return executor, prepared.tokenizer, prepared.config.vocab_size


def run_fixed(engine: Engine, timed: TimedExecutor, prompts: list[list[int]],
              output_len: int) -> dict:
    """Every prompt at once, then steps until all are done. The decode window runs from the
    step after the last first token to the step before the first request finishes; its split
    (per round: one token for every sequence) is Python (the engine), communication (rank 0
    inside collectives) and compute (the rest of the executor, waiting for later stages
    included)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [RequestId(f"w{time.monotonic_ns()}-{i}") for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(Request(rid, list(p), params, arrival_time=time.monotonic()))
    first: dict[RequestId, float] = {}
    last: dict[RequestId, float] = {}
    steps: list[tuple[float, float, float, int, bool]] = []  # step, exec, comm s, tokens, decode
    tokens = 0
    timed.take()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        exec_s, comm_s = timed.take()
        new = sum(len(o.new_token_ids) for o in outs)
        tokens += new
        decoding = len(first) == len(ids) and all(not o.finished for o in outs)
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
        steps.append((now - t0, exec_s, comm_s, new, decoding))
    elapsed = time.perf_counter() - start
    window = [s for s in steps if s[4]]
    rounds = sum(s[3] for s in window) / len(ids)
    step_s, exec_s, comm_s = (sum(s[i] for s in window) for i in range(3))
    ttft = sorted(first[r] - start for r in ids)
    tpot = statistics.median((last[r] - first[r]) / (output_len - 1) for r in ids)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "decode_tokens_per_s": sum(s[3] for s in window) / step_s,
            "tpot_ms": tpot * 1e3, "ttft_batch_p50_ms": ttft[len(ttft) // 2] * 1e3,
            "ttft_batch_max_ms": ttft[-1] * 1e3,
            "decode_round_ms": step_s / rounds * 1e3, "decode_comm_ms": comm_s / rounds * 1e3,
            "decode_compute_ms": (exec_s - comm_s) / rounds * 1e3,
            "decode_python_ms": (step_s - exec_s) / rounds * 1e3}


def single_ttft(engine: Engine, prompts: list[list[int]]) -> float:
    """Median time to the first token of one prompt alone (no prefix cached), in ms."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    samples = []
    for i, p in enumerate(prompts):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        engine.add_request(Request(RequestId(f"t{i}"), list(p), params,
                                   arrival_time=time.monotonic()))
        while engine.has_unfinished_requests():
            engine.step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def workload(args: argparse.Namespace) -> dict:
    executor, tokenizer, vocab = build(args.tp, args.pp, args.threads, args.dtype)
    timed = TimedExecutor(executor)
    kv_gb = 1.0
    cache = CacheConfig(block_size=16,
                        num_blocks=CacheConfig.blocks_for_gb(kv_gb, timed.kv_bytes_per_token(), 16))
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)
    engine = Engine(timed, cache, sched, tokenizer, vocab_size=vocab)  # type: ignore[arg-type]
    run_fixed(engine, timed, random_prompts(4, 32, vocab, 99), 8)  # warm up
    engine.reset_prefix_cache()
    before = executor.pipeline_stats() if hasattr(executor, "pipeline_stats") else None
    result = run_fixed(engine, timed, random_prompts(args.num, args.input_len, vocab, 0),
                       args.output_len)
    if before is not None:
        after = executor.pipeline_stats()
        result["stage_busy_fraction"] = list(after.busy_fractions(before))
    result["ttft_single_ms"] = single_ttft(engine, random_prompts(3, args.input_len, vocab, 7))
    result |= {"bench": "workload", "tp": args.tp, "pp": args.pp,
               "threads_per_rank": args.threads, "dtype": args.dtype,
               "load_avg_1m": os.getloadavg()[0]}
    result |= _ranks(executor)
    sizes, times = zip(*timed.pickle_samples, strict=True)
    result |= {"whole_input_pickle_bytes": statistics.median(sizes),
                "whole_input_pickle_us": statistics.median(times) * 1e6}
    if hasattr(executor, "shutdown"):
        executor.shutdown()
    return result


def _ranks(executor: Any) -> dict:
    if not hasattr(executor, "rank_memory"):
        from strata.model.parallel.rank import _weight_bytes

        return {"rank_weight_mib": [_weight_bytes(executor) / 2**20],
                "rank_rss_mib": [rss_bytes(os.getpid()) / 2**20]}
    memory = executor.rank_memory()
    stats = executor.stats
    return {"rank_weight_mib": [m.weight_bytes / 2**20 for m in memory],
            "rank_kv_mib": [m.kv_bytes / 2**20 for m in memory],
            "rank_rss_mib": [rss_bytes(m.pid) / 2**20 for m in memory],
            "step_broadcast_bytes": stats.num_bytes / max(stats.num_steps, 1),
            "step_encode_us": stats.encode_ns / max(stats.num_steps, 1) / 1e3}


def table(rows: list[dict]) -> str:
    """The markdown tables of docs/benchmarks.md from the JSON lines of the runs above."""
    lines = ["| all-reduce | size | p50 us | p99 us |", "|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['size']} floats | {r['p50_us']:.1f} | {r['p99_us']:.1f} |"
              for r in rows if r["bench"] == "allreduce"]
    runs = [r for r in rows if r["bench"] == "workload"]
    if not runs:
        return "\n".join(lines)
    base = next((r for r in runs if r["tp"] * r.get("pp", 1) == 1), runs[0])
    lines += ["", "| layout | threads/rank | out tok/s | x T=1 | decode tok/s | TTFT batch p50 ms"
              " | TTFT 1 prompt ms | TPOT ms | round ms: compute / comm / Python"
              " | stage busy | weights MiB/rank | x T=1 | RSS MiB/rank | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        tp, pp = r["tp"], r.get("pp", 1)
        name = "T=1" if tp * pp == 1 else "x".join(
            [*([f"T={tp}"] if tp > 1 else []), *([f"P={pp}"] if pp > 1 else [])])
        weights = max(r["rank_weight_mib"])
        busy = " / ".join(f"{b:.2f}" for b in r.get("stage_busy_fraction", [])) or "-"
        lines.append(
            f"| {name} | {r['threads_per_rank']} | {r['tokens_per_s']:.1f}"
            f" | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.1f}"
            f" | {r['ttft_batch_p50_ms']:.0f} | {r['ttft_single_ms']:.0f} | {r['tpot_ms']:.0f}"
            f" | {r['decode_compute_ms']:.1f} / {r['decode_comm_ms']:.1f}"
            f" / {r['decode_python_ms']:.1f} | {busy} | {weights:.0f}"
            f" | {weights / max(base['rank_weight_mib']):.2f}"
            f" | {' / '.join(f'{m:.0f}' for m in r['rank_rss_mib'])} | {r['load_avg_1m']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    ar = sub.add_parser("allreduce")
    ar.add_argument("--iters", type=int, default=2000)
    tb = sub.add_parser("table", help="markdown tables from the JSON lines of earlier runs")
    tb.add_argument("files", nargs="+", type=Path)
    wl = sub.add_parser("workload")
    wl.add_argument("--tp", type=int, default=1)
    wl.add_argument("--pp", type=int, default=1)
    wl.add_argument("--threads", type=int, default=None,
                    help="per rank (default: 2 for one process, else 1)")
    wl.add_argument("--dtype", default="bfloat16")
    add_workload_args(wl)
    args = ap.parse_args()
    if args.what == "table":
        found = [json.loads(line) for f in args.files for line in f.read_text().splitlines()
                 if line.startswith("{")]
        print(table(found))
        return
    if args.what == "allreduce":
        rows = allreduce(args.iters)
    else:
        args.threads = args.threads or (2 if args.tp * args.pp == 1 else 1)
        rows = [workload(args)]
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
