"""Tensor parallel on one host: what the collectives cost, what T ranks buy on the fixed workload.

Usage (JSON lines on stdout, a markdown table on stderr):
    .venv/bin/python bench/parallel.py allreduce [--iters 2000]
    .venv/bin/python bench/parallel.py workload --tp 1 --threads 2
    .venv/bin/python bench/parallel.py workload --tp 2 --threads 1
    .venv/bin/python bench/parallel.py workload --tp 3 --threads 1

allreduce: p50/p99 latency of one all_reduce between two processes, shared memory against gloo
(TCP on 127.0.0.1), for 576 floats (one decode row of SmolLM2) and 32 x 576 (a batch).

workload: the Stage 1 fixed workload (bench/workload.py: 32 prompts x 128 tokens in, 64 out,
bf16, greedy) on SmolLM2 through the real Engine, one process (--tp 1) or T ranks. Reports output
tok/s; the decode step (steps where every sequence decodes) split into communication (rank 0's
time inside collectives, waiting for slower ranks included), compute (the rest of the
executor's time: forward and sampling) and Python (the engine around the executor); RSS and
weight bytes per rank; bytes and encode time of the step broadcast.
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_workload_args, random_prompts  # noqa: E402

from strata.engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.executor import ModelInput, ModelOutput  # noqa: E402
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
    """Times `execute` (and rank 0's collectives inside it) of the wrapped executor."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last_s = 0.0
        self.last_comm_s = 0.0
        self.pickle_samples: list[tuple[int, float]] = []  # (bytes, seconds) of a whole input

    def kv_bytes_per_token(self) -> int:
        return int(self.inner.kv_bytes_per_token())

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.inner.allocate_kv_cache(num_blocks, block_size)

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Also pickles the whole input once, untimed: what sending it to each rank would cost."""
        start = time.perf_counter()
        size = len(pickle.dumps(model_input, pickle.HIGHEST_PROTOCOL))
        self.pickle_samples.append((size, time.perf_counter() - start))
        comm = self._comm()
        start = time.perf_counter()
        out: ModelOutput = self.inner.execute(model_input)
        self.last_s = time.perf_counter() - start
        self.last_comm_s = self._comm() - comm
        return out

    def _comm(self) -> float:
        return float(self.inner.comm_seconds()) if hasattr(self.inner, "comm_seconds") else 0.0


def build(tp: int, threads: int, dtype: str) -> tuple[Any, Any, int]:
    """(executor, tokenizer, vocab) for one process or `tp` ranks."""
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    torch.set_num_threads(threads)
    if tp == 1:
        from strata.model.executor import TorchExecutor
        from strata.model.loader import load_model

        loaded = load_model(path, dtype=dtype, cache_dir=CACHE_DIR)
        executor = TorchExecutor(loaded.config, loaded.weights, dtype=dtype)
        loaded.weights.clear()
        return executor, loaded.tokenizer, loaded.config.vocab_size
    from strata.model.parallel.executor import ParallelExecutor
    from strata.model.parallel.layout import ParallelLayout
    from strata.model.parallel.shard_loader import prepare_model

    prepared = prepare_model(path, dtype=dtype, cache_dir=CACHE_DIR)
    executor = ParallelExecutor(prepared, ParallelLayout(tensor_size=tp), dtype=dtype,
                                threads=threads)
    return executor, prepared.tokenizer, prepared.config.vocab_size


def run_fixed(engine: Engine, timed: TimedExecutor, prompts: list[list[int]],
              output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(Request(RequestId(f"w{time.monotonic_ns()}-{i}"), list(p), params,
                                   arrival_time=time.monotonic()))
    decode: list[tuple[float, float, float]] = []  # (step, execute, comm) seconds
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        step_s = time.perf_counter() - t0
        tokens += sum(len(o.new_token_ids) for o in outs)
        if len(outs) == len(prompts) and all(o.num_output_tokens > 1 for o in outs):
            decode.append((step_s, timed.last_s, timed.last_comm_s))
    elapsed = time.perf_counter() - start
    step = statistics.median(d[0] for d in decode)
    execute = statistics.median(d[1] for d in decode)
    comm = statistics.median(d[2] for d in decode)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "decode_step_ms": step * 1e3, "decode_comm_ms": comm * 1e3,
            "decode_compute_ms": (execute - comm) * 1e3, "decode_python_ms": (step - execute) * 1e3}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def workload(args: argparse.Namespace) -> dict:
    executor, tokenizer, vocab = build(args.tp, args.threads, args.dtype)
    timed = TimedExecutor(executor)
    kv_gb = 1.0
    cache = CacheConfig(block_size=16,
                        num_blocks=CacheConfig.blocks_for_gb(kv_gb, timed.kv_bytes_per_token(), 16))
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)
    engine = Engine(timed, cache, sched, tokenizer, vocab_size=vocab)  # type: ignore[arg-type]
    run_fixed(engine, timed, random_prompts(4, 32, vocab, 99), 8)  # warm up
    engine.reset_prefix_cache()
    result = run_fixed(engine, timed, random_prompts(args.num, args.input_len, vocab, 0),
                       args.output_len)
    result |= {"bench": "workload", "tp": args.tp, "threads_per_rank": args.threads,
               "dtype": args.dtype, "load_avg_1m": os.getloadavg()[0]}
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


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    ar = sub.add_parser("allreduce")
    ar.add_argument("--iters", type=int, default=2000)
    wl = sub.add_parser("workload")
    wl.add_argument("--tp", type=int, default=1)
    wl.add_argument("--threads", type=int, default=None,
                    help="per rank (default: 2 for --tp 1, else 1)")
    wl.add_argument("--dtype", default="bfloat16")
    add_workload_args(wl)
    args = ap.parse_args()
    if args.what == "allreduce":
        rows = allreduce(args.iters)
    else:
        args.threads = args.threads or (2 if args.tp == 1 else 1)
        rows = [workload(args)]
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
