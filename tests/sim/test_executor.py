"""SimulatedExecutor inside the real Engine: step times follow the profile, prefix-cache hits
shorten prefill, tokens are deterministic words (never EOS)."""

from __future__ import annotations

import pytest

from strata.engine.request import Request, SamplingParams
from strata.sim.profile import LatencyProfile
from strata.sim.server import SimulatedEngineParts, build_simulated_engine
from strata.sim.tokenizer import word_token_ids
from strata.types import RequestId

PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.5, decode_ms_base=10.0, decode_ms_per_seq=1.0,
                         decode_ms_per_context_token=0.25)


def _engine(slept: list[float], **kw: object) -> SimulatedEngineParts:
    return build_simulated_engine(PROFILE, sleep=slept.append, block_size=16, kv_blocks=64,
                                  max_num_seqs=8, max_model_len=256, **kw)  # type: ignore[arg-type]


def _run(parts: SimulatedEngineParts, *requests: Request) -> dict[str, list[int]]:
    for r in requests:
        parts.engine.add_request(r)
    out: dict[str, list[int]] = {}
    while parts.engine.has_unfinished_requests():
        for o in parts.engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _req(rid: str, prompt: list[int], max_tokens: int = 3, **kw: object) -> Request:
    return Request(RequestId(rid), prompt, SamplingParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]


def _ms(slept: list[float]) -> list[float]:
    return [round(s * 1000, 9) for s in slept]


def test_step_times_follow_the_profile() -> None:
    slept: list[float] = []
    parts = _engine(slept)
    _run(parts, _req("a", list(range(100, 110)), max_tokens=3))
    # prefill 10 tokens; then 2 decode steps attending to 11 and 12 tokens
    assert _ms(slept) == [2.0 + 0.5 * 10, 10.0 + 1.0 + 0.25 * 11, 10.0 + 1.0 + 0.25 * 12]
    assert parts.executor.num_steps == 3
    assert parts.executor.busy_s == pytest.approx(sum(slept))


def test_a_batch_of_decodes_costs_one_step() -> None:
    slept: list[float] = []
    parts = _engine(slept)
    _run(parts, _req("a", [100] * 4, max_tokens=2), _req("b", [101] * 6, max_tokens=2))
    # both prompts in one prefill step, then one decode step for two sequences (5 + 7 context)
    assert _ms(slept) == [2.0 + 0.5 * 10, 10.0 + 2 * 1.0 + 0.25 * 12]


def test_a_prefix_cache_hit_lowers_the_prefill_time() -> None:
    slept: list[float] = []
    parts = _engine(slept)
    prompt = list(range(200, 240))  # 40 tokens: two full blocks of 16 become cacheable
    _run(parts, _req("first", prompt, max_tokens=1))
    assert _ms(slept) == [2.0 + 0.5 * 40]
    slept.clear()
    _run(parts, _req("second", prompt, max_tokens=1))
    assert _ms(slept) == [2.0 + 0.5 * 8]  # only the 8 tokens after the cached 32 are computed
    assert parts.engine.stats().prefix_cache_hits == 32


def test_tokens_are_deterministic_words_and_never_eos() -> None:
    parts = _engine([])
    words = set(word_token_ids(parts.tokenizer))
    out = _run(parts, _req("r1", [100, 101], max_tokens=20, temperature=1.0),
               _req("r2", [100, 101], max_tokens=20, temperature=1.0),
               _req("s1", [7], max_tokens=5, seed=42), _req("s2", [9, 9], max_tokens=5, seed=42),
               _req("g1", [5, 6], max_tokens=5, temperature=0.0),
               _req("g2", [5, 6], max_tokens=5, temperature=0.0))
    assert all(len(t) == n for t, n in zip(out.values(), [20, 20, 5, 5, 5, 5], strict=True))
    assert all(t in words for tokens in out.values() for t in tokens)
    assert out["r1"] != out["r2"]  # unseeded sampling differs between requests
    assert out["s1"] == out["s2"]  # the same seed gives the same tokens
    assert out["g1"] == out["g2"]  # greedy: the same prompt gives the same tokens
    again = _run(_engine([]), _req("r1", [100, 101], max_tokens=20, temperature=1.0))
    assert again["r1"] == out["r1"]
    assert not set(parts.tokenizer.eos_token_ids) & {t for v in out.values() for t in v}


def test_logprobs_are_plausible_and_ranked() -> None:
    parts = _engine([])
    parts.engine.add_request(_req("lp", [100, 101], max_tokens=4, logprobs=3))
    outputs = []
    while parts.engine.has_unfinished_requests():
        outputs += parts.engine.step()
    assert len(outputs) == 4
    for o in outputs:
        (lp,) = o.new_logprobs
        assert lp.token_id == o.new_token_ids[0]
        assert -2.5 < lp.logprob <= -0.05
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert len({t for t, _ in lp.top}) == 3


def test_kv_cache_gb_buys_as_many_blocks_as_for_the_real_model() -> None:
    from strata.sim.server import sim_kv_blocks

    assert sim_kv_blocks(PROFILE, 1.0, 16) == (1 << 30) // (23040 * 16)  # SmolLM2 by default
    sized = LatencyProfile("m", "synthetic", 1.0, 1.0, 1.0, 1.0, kv_bytes_per_token=1024)
    assert sim_kv_blocks(sized, 0.5, 16) == (1 << 29) // (1024 * 16)
