"""Batched sampling: greedy, temperature, top-k/top-p, seeds, penalties and logprobs."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from strata.engine.request import SamplingParams
from strata.model.sampler import Sampler, seed_for_step

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample_ids(sampler: Sampler, logits: Tensor, params: list[SamplingParams],
               outputs: list[list[int]] | None = None) -> list[int]:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return [t.token_id for t in sampler.sample(logits, params, outputs)]


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits(6)
    tokens = sample_ids(Sampler(seed=0), logits, [SamplingParams(temperature=0.0)] * 6)
    assert tokens == logits.argmax(-1).tolist()


def test_a_temperature_too_small_to_divide_by_is_greedy_even_with_logits_masked() -> None:
    """Found by the fuzzer against a real model: temperature 5e-324 with structured output
    scaled the allowed logits to inf and the masked ones stayed -inf: a NaN draw and a 500."""
    logits = random_logits(4, seed=9)
    logits[:, ::2] = float("-inf")  # what a grammar's mask leaves: half the vocabulary
    params = [SamplingParams(temperature=t, seed=1) for t in (5e-324, 1e-300, 1e-8, 9e-6)]
    assert all(p.is_greedy for p in params)
    assert sample_ids(Sampler(seed=0), logits, params) == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature() -> None:
    logits = random_logits(8, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 4 + [
        SamplingParams(temperature=1.5, top_p=1e-6)] * 4
    for seed in range(5):
        assert sample_ids(Sampler(seed=seed), logits, params) == logits.argmax(-1).tolist()


def test_top_k_keeps_draws_inside_the_k_best() -> None:
    logits = random_logits(1, seed=2).expand(200, VOCAB).contiguous()
    tokens = sample_ids(Sampler(seed=3), logits, [SamplingParams(temperature=2.0, top_k=3)] * 200)
    best3 = set(logits[0].topk(3).indices.tolist())
    assert set(tokens) == best3  # 200 hot draws reach all three, and nothing else


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(300, 4).contiguous()
    tokens = sample_ids(Sampler(seed=4), logits, [SamplingParams(top_p=0.7)] * 300)
    assert set(tokens) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


def test_unseeded_temperature_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(3000, 3).contiguous()
    tokens = torch.tensor(sample_ids(Sampler(seed=5), logits, [SamplingParams()] * 3000))
    freqs = torch.bincount(tokens, minlength=3).float() / 3000
    torch.testing.assert_close(freqs, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0.0)


def test_same_seed_same_tokens_whatever_the_batch_neighbours() -> None:
    row = random_logits(1, seed=6)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [sample_ids(Sampler(seed=0), row, [seeded], [[9] * n]) for n in range(20)]
    crowded = []
    for n in range(20):
        batch = torch.cat([random_logits(3, seed=100 + n), row])
        params = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0),
                  seeded]
        crowded.append(sample_ids(Sampler(seed=n), batch, params, [[1], [], [2], [9] * n])[3])
    assert [a[0] for a in alone] == crowded
    assert len(set(crowded)) > 1  # the draw moves on with the number of generated tokens


def test_different_seeds_give_different_tokens() -> None:
    row = random_logits(1, seed=8)
    runs = {tuple(sample_ids(Sampler(), row, [SamplingParams(seed=seed)], [[0] * n])[0]
                  for n in range(16)) for seed in (1, 2)}
    assert len(runs) == 2
    assert seed_for_step(1, 0) != seed_for_step(1, 1) != seed_for_step(2, 0)


def test_presence_and_frequency_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.5, 4.0, 0.0]])
    sampler = Sampler(seed=0)
    history = [[0]]
    assert sample_ids(sampler, logits, [SamplingParams(temperature=0.0)], history) == [0]
    presence = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample_ids(sampler, logits, [presence], history) == [1]  # 5 - 1 < 4.5
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert sample_ids(sampler, logits, [frequency], [[0, 1]]) == [0]  # 4.6 > 4.1
    assert sample_ids(sampler, logits, [frequency], [[0, 0, 0, 1, 1]]) == [2]  # 3.8, 3.7 < 4.0
    negative = SamplingParams(temperature=0.0, presence_penalty=-2.0)
    assert sample_ids(sampler, logits, [negative], [[2]]) == [2]  # encourages repeating 2


@pytest.mark.parametrize("num_top", [0, 1, 5])
def test_logprobs_are_raw_log_softmax_and_sorted(num_top: int) -> None:
    logits = random_logits(3, seed=9)
    params = [SamplingParams(temperature=0.7, logprobs=num_top, presence_penalty=1.5, seed=1),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=num_top)]
    sampled = Sampler(seed=0).sample(logits, params, [[3, 4], [], []])
    expected = torch.log_softmax(logits, dim=-1)  # before penalties and temperature
    assert sampled[1].logprob is None
    for row in (0, 2):
        lp = sampled[row].logprob
        assert lp is not None and lp.token_id == sampled[row].token_id
        assert lp.logprob == pytest.approx(float(expected[row, lp.token_id]), abs=1e-6)
        assert len(lp.top) == num_top
        assert [t for t, _ in lp.top] == expected[row].topk(num_top).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for token, value in lp.top:
            assert value == pytest.approx(float(expected[row, token]), abs=1e-6)
