"""Issue 26's throughput row over HTTP, against any OpenAI-compatible server that serves LoRA
adapters (Strata or vLLM-CPU, side by side): the fixed load (32 requests x ~128 prompt tokens ->
64 output tokens, all at once, ignore_eos) on the base model, then with every request on one of
the adapters round-robin; output tokens per second of each, interleaved for `--rounds`.

    .venv/bin/python bench/lora_http.py --url http://127.0.0.1:18600 --base smollm2 \\
        --adapters a0 a1 a2 a3 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

WORDS = ("river mill town night spring summer stone bridge market lantern harbor field "
         "winter orchard chapel meadow valley forest mountain candle").split()


async def fixed_load(url: str, models: list[str], seed: int, num: int = 32,
                     words: int = 100, output_len: int = 64) -> float:
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num)]
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int) -> int:
            r = await client.post("/v1/completions", json={
                "model": models[i % len(models)], "prompt": prompts[i],
                "max_tokens": output_len, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(num)))
        return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapters", nargs="+", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    asyncio.run(fixed_load(a.url, [a.base], seed=99, num=4))  # warm up
    asyncio.run(fixed_load(a.url, a.adapters, seed=98, num=4))
    rows = []
    for r in range(a.rounds):
        base = asyncio.run(fixed_load(a.url, [a.base], seed=2 * r))
        lora = asyncio.run(fixed_load(a.url, a.adapters, seed=2 * r + 1))
        rows.append({"base_tok_s": round(base, 1), "adapters_tok_s": round(lora, 1),
                     "ratio": round(lora / base, 3)})
    print(json.dumps({"url": a.url, "adapters": len(a.adapters), "rounds": rows}))


if __name__ == "__main__":
    main()
