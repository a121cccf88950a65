"""vLLM CPU offline throughput on the fixed workload (run with vLLM's own venv python).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    .bench/vllm/bin/python bench/vllm_offline.py --model .bench/smollm2-hf
Prints one JSON line: output tokens, seconds, tokens/s (generate() only, after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_workload_args, random_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, seed=0)
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0)
    warm = [TokensPrompt(prompt_token_ids=p) for p in random_prompts(4, 32, 49152, 99)]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for i in range(a.repeats):
        prompts = [TokensPrompt(prompt_token_ids=p)
                   for p in random_prompts(a.num, a.input_len, 49152, i)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        total = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"engine": "vllm", "output_tokens": total, "seconds": dt,
                          "tokens_per_s": total / dt}), flush=True)


if __name__ == "__main__":
    main()
