"""The adaptive prefill budget: a long prompt arriving beside running decodes is fed in chunks
small enough that no decode step stretches beyond `prefill_stretch` times its usual length.

Story: the fake model's steps cost time on an injected clock: 10 ms per step plus 0.1 ms per
prefill token. Sixteen requests decode; then a 600-token prompt arrives. With the default
stretch of 1.5, every step beside the decodes carries at most (1.5 - 1) x 10 ms / 0.1 ms = 50
prefill tokens once the costs are measured (the first steps measure them), so the decodes' step
times stay within 1.5x; every request still gets exactly its solo tokens. With the cap off the
prompt goes in 240-token chunks (the 256-token budget less the 16 decodes). Only a long prompt
(over the 256-token budget) is capped: eight 60-token prompts arriving beside the same decodes
go in at the budget's full speed, while a long prompt arriving with them still goes in chunks.
"""

from __future__ import annotations

import pytest
from engine_fakes import (
    FakeExecutor,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.engine.executor import ModelInput, ModelOutput
from strata.engine.step_budget import StepBudget
from strata.errors import ConfigError

STEP_S, TOKEN_S = 0.010, 0.0001


class TimedExecutor(FakeExecutor):
    """The fake model, whose steps advance `now` by a fixed cost plus a cost per prefill token."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.step_shapes: list[tuple[int, int]] = []  # (decode rows, prefill tokens)
        self.chunks: list[dict[str, int]] = []  # per step: request id -> prefill tokens

    def execute(self, model_input: ModelInput) -> ModelOutput:
        sizes = [len(s.token_ids) for s in model_input.sequences]
        prefill = sum(n for n in sizes if n > 1)
        self.step_shapes.append((sizes.count(1), prefill))
        self.chunks.append({s.request_id: len(s.token_ids) for s in model_input.sequences
                            if len(s.token_ids) > 1})
        self.now += STEP_S + TOKEN_S * prefill
        return super().execute(model_input)


def run_interference(stretch: float, num_short: int = 0,
                     long_len: int = 600) -> tuple[TimedExecutor, list[str], str]:
    """16 decodes; after 6 steps `num_short` 60-token prompts and a `long_len` one arrive.
    Returns the executor, the short prompts' ids and the long one's."""
    executor = TimedExecutor()
    engine, _ = make_engine(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=256,
                            max_model_len=1024, executor=executor, prefill_stretch=stretch,
                            step_clock=lambda: executor.now)
    decoders = [make_request(prompt_of(12, start=i), 40) for i in range(16)]
    for r in decoders:
        engine.add_request(r)
    early: dict[str, list[int]] = {}
    for _ in range(6):
        for out in engine.step():
            early.setdefault(out.request_id, []).extend(out.new_token_ids)
    shorts = [make_request(prompt_of(60, start=200 + 7 * i), 4) for i in range(num_short)]
    long = make_request(prompt_of(long_len, start=99), 4)
    for r in [*shorts, long]:
        engine.add_request(r)
    tokens = run_to_completion(engine)
    for rid, first in early.items():
        tokens[rid] = first + tokens.get(rid, [])  # type: ignore[index]
    for r in [*decoders, *shorts, long]:
        assert tokens[r.request_id] == reference_tokens(r.prompt_token_ids,
                                                        r.sampling_params.max_tokens)
    return executor, [r.request_id for r in shorts], long.request_id


def test_a_long_prompt_beside_decodes_goes_in_chunks_within_the_stretch() -> None:
    shapes = run_interference(1.5)[0].step_shapes
    beside = [p for d, p in shapes if d >= 8 and p > 0]
    assert sum(beside) >= 600 - 256  # most of the long prompt ran beside the decodes
    assert max(beside) <= 50
    assert len(beside) >= 12


def test_without_the_cap_the_prompt_takes_the_whole_budget() -> None:
    shapes = run_interference(0.0)[0].step_shapes
    assert max(p for d, p in shapes if d == 16) == 256 - 16


def test_a_burst_of_short_prompts_beside_decodes_is_admitted_at_full_speed() -> None:
    executor, shorts, long = run_interference(1.5, num_short=8)
    arrival = 6  # the first step that can see them
    steps = executor.chunks[arrival:]
    # 8 x 60 tokens in the budget left beside 16 (then 20) decodes: two steps, where 50
    # tokens at a time would take ten
    assert sum(c.get(rid, 0) for rid in shorts for c in steps[:1]) == 256 - 16
    assert not any(rid in c for rid in shorts for c in steps[2:])
    assert max(c.get(long, 0) for c in steps) <= 50  # the long one still goes in chunks
    assert sum(c.get(long, 0) for c in steps) == 600


def test_a_prompt_within_the_budget_is_not_capped() -> None:
    executor, _, long = run_interference(1.5, long_len=200)
    assert [c[long] for c in executor.chunks if long in c] == [200]


def test_estimates_and_cap() -> None:
    budget = StepBudget(stretch=2.0, floor=16)
    assert budget.prefill_cap(4) is None  # nothing measured
    budget.observe(0, 512, 0.512)  # prefill alone: 1 ms per token, an overestimate
    assert budget.prefill_cap(4) is None  # no decode step measured yet
    budget.observe(4, 0, 0.020)
    assert budget.prefill_cap(4) == 20  # (2 - 1) x 20 ms / 1 ms
    assert budget.prefill_cap(0) is None  # no decode to protect
    budget.observe(4, 100, 0.020 + 100 * 0.0005)  # beside decodes: the base is taken off
    assert budget.token_s == pytest.approx(0.7 * 0.001 + 0.3 * 0.0005)
    budget.observe(4, 8, 1.0)  # too few tokens to say anything
    assert budget.token_s == pytest.approx(0.00085)
    budget.observe(4, 0, 10.0)  # a very slow decode step
    assert budget.prefill_cap(4) > 1000
    slow = StepBudget(stretch=1.5, floor=16)
    slow.observe(1, 0, 0.001)
    slow.observe(1, 64, 0.1)
    assert slow.prefill_cap(1) == 16  # never below the floor


def test_stretch_must_exceed_one_or_be_off() -> None:
    with pytest.raises(ConfigError, match="prefill_stretch"):
        make_engine(prefill_stretch=1.0)
