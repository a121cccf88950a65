"""Per-shape matmul timings: oneDNN's packed bf16 matmul against Strata's C kernels.

For every linear layer shape of the default model (SmolLM2-135M: qkv, o, gate_up, down, lm_head)
and row counts 1 .. 512, times `reps` calls of each kernel, interleaved call by call, and reports
the minimum and median microseconds (the minimum is the least disturbed by other processes on
a shared machine) and the weight bandwidth it implies. The C kernels run as "vector" and, where
the CPU has AMX, as "-amx". Decides `gemm.AMX_MIN_ROWS` and where bf16 weights get the C kernel.

    .venv/bin/python bench/gemm_shapes.py [--rows 1 8 32 64 128] [--reps 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from strata.model import gemm
from strata.model.linear import linear, pack_linear_weight
from strata.model.quant import quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _time(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64, 96, 128, 512])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--kinds", nargs="+", default=["bf16", "q8_0", "q4_1"])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    print(f"load average {os.getloadavg()[0]:.1f}; us per call, min / median of {args.reps}")
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k).bfloat16() * 0.05
        packed_w = pack_linear_weight(w)  # oneDNN's packed copy, whatever `linear` would pick
        onednn = packed_w.dense if isinstance(packed_w, gemm.PackedWeight) else packed_w
        assert onednn is not None and onednn.is_mkldnn
        packed = {"bf16": gemm.pack(w)} if gemm.supports_bf16() else {}
        packed |= {kind: gemm.pack(quantize(w.float(), kind))
                   for kind in args.kinds if kind != "bf16"}
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            fns: dict[str, Callable[[], object]] = {
                "onednn": lambda x=x, w=onednn: linear(x, w)}
            for kind, p in packed.items():
                if kind in args.kinds:
                    fns[kind] = lambda x=x, p=p: gemm.matmul(x, p, kernel="vector")
                    if gemm.has_amx():
                        fns[f"{kind}-amx"] = lambda x=x, p=p: gemm.matmul(x, p, kernel="amx")
            times = _time(fns, args.reps if m < 256 else max(10, args.reps // 10))
            row = {"shape": shape, "n": n, "k": k, "m": m}
            line = f"{shape:8s} m={m:4d}"
            for name, ts in times.items():
                lo, med = min(ts), statistics.median(ts)
                kind = name.removesuffix("-amx")
                nbytes = packed[kind].nbytes if kind in packed else n * k * 2
                row[name] = {"min_us": lo, "median_us": med, "gb_s": nbytes / lo / 1e3}
                line += f" | {name} {lo:8.1f} / {med:8.1f}"
            base = row["onednn"]["min_us"]  # type: ignore[index]
            line += " | x oneDNN: " + " ".join(
                f"{name} {base / row[name]['min_us']:.2f}"  # type: ignore[index]
                for name in times if name != "onednn")
            print(line, flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_avg": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
