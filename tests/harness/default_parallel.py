"""The default model (SmolLM2-135M, float32) split across ranks against one process: greedy
runs of fixed prompts and the rule that holds them together. The test runs `CI_PROMPTS` (10);
bench/default_model_parallel.py runs `ALL_PROMPTS` (50), the figure docs/benchmarks.md gives.

The rule (`compare`): identical greedy continuations, logprobs within 1e-4 until two runs part,
and a parting only at a near tie of the one-process run (its top two logprobs within 1e-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelExecutor
from strata.engine.request import Logprob, Request, SamplingParams
from strata.types import RequestId

NUM_TOKENS = 16
SUBJECTS = ["the sea", "a small town", "bread", "the moon", "rain", "a library", "trains",
            "winter", "a garden", "music"]
FORMS = ["Write one sentence about {}.", "What is the best thing about {}?",
         "Tell a short story about {}.", "List three facts about {}.",
         "Explain {} to a child."]
ALL_PROMPTS = [f.format(s) for s in SUBJECTS for f in FORMS]  # 50
CI_PROMPTS = [FORMS[i % len(FORMS)].format(s) for i, s in enumerate(SUBJECTS)]  # 10, each form
LOGPROB_TOLERANCE = 1e-4
NEAR_TIE = 1e-3

Run = list[tuple[list[int], list[Logprob]]]


def run(executor: ModelExecutor, vocab_size: int, tokenizer: object,
        prompts: list[str]) -> Run:
    """Greedy runs of `prompts`, all in one engine at once, with top-2 logprobs."""
    engine = Engine(executor, CacheConfig(block_size=16, num_blocks=512),
                    SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                    max_model_len=512),
                    tokenizer, vocab_size=vocab_size)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    encode = tokenizer.encode  # type: ignore[attr-defined]
    for i, text in enumerate(prompts):
        engine.add_request(Request(RequestId(f"p{i}"), encode(text), params,
                                   arrival_time=float(i)))
    out: dict[str, tuple[list[int], list[Logprob]]] = {f"p{i}": ([], [])
                                                       for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.new_logprobs)
    return [out[f"p{i}"] for i in range(len(prompts))]


@dataclass(frozen=True)
class Comparison:
    num_identical: int
    num_prompts: int
    worst_logprob_difference: float  # before parting
    partings: list[str]  # where two runs parted, at a near tie

    def line(self, name: str) -> str:
        return (f"{name} vs T=1: {self.num_identical}/{self.num_prompts} identical over "
                f"{NUM_TOKENS} tokens, worst logprob difference before parting "
                f"{self.worst_logprob_difference:.2e}")


def compare(single: Run, split: Run, prompts: list[str]) -> Comparison:
    """Hold `split` to `single` by the rule above (AssertionError where it breaks)."""
    worst, partings, same = 0.0, [], 0
    for i, ((tokens, lps), (other, other_lps)) in enumerate(zip(single, split, strict=True)):
        part = next((j for j, (a, b) in enumerate(zip(tokens, other, strict=True)) if a != b),
                    len(tokens))
        same += part == len(tokens)
        for a, b in zip(lps[:part], other_lps[:part], strict=True):
            worst = max(worst, abs(a.logprob - b.logprob))
        if part < len(tokens):  # they parted: it must be a near tie where one process decided
            gap = lps[part].top[0][1] - lps[part].top[1][1]
            assert gap < NEAR_TIE, f"prompt {i} ({prompts[i]!r}) parts at token {part}, gap {gap}"
            partings.append(f"prompt {i} at token {part} (gap {gap:.1e})")
    assert worst < LOGPROB_TOLERANCE, worst
    return Comparison(same, len(prompts), worst, partings)


__all__ = ["ALL_PROMPTS", "CI_PROMPTS", "NUM_TOKENS", "Comparison", "Run", "compare", "run"]
