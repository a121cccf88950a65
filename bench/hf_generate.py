"""HF transformers `generate` (static batching) on the fixed workload: the naive baseline.

    .venv/bin/python bench/hf_generate.py --model .bench/smollm2-hf [--threads 2]
Prints one JSON line (generate() only, after a warm-up). All prompts have the same length, so the
batch needs no padding; `min_new_tokens` = `max_new_tokens` plays the part of ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_workload_args, random_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    add_workload_args(ap)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size

    def generate(ids: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0)

    generate(torch.tensor(random_prompts(4, 32, vocab, 99)), 8)
    ids = torch.tensor(random_prompts(a.num, a.input_len, vocab, 0))
    t0 = time.perf_counter()
    out = generate(ids, a.output_len)
    dt = time.perf_counter() - t0
    total = (out.shape[1] - ids.shape[1]) * out.shape[0]
    print(json.dumps({"engine": "hf", "output_tokens": total, "seconds": dt,
                      "tokens_per_s": total / dt, "threads": a.threads}))


if __name__ == "__main__":
    main()
