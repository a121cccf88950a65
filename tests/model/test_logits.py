"""Logits processors: logit_bias, repetition/presence/frequency penalties, min_tokens and a
constraint's mask, batched, against Hugging Face's processors where HF has the same one, and
through the engine on a tiny random model against HF `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_fakes import run_to_completion
from tiny_models import make_tiny_model_dir
from torch import Tensor
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.errors import InvalidRequestError
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.model.logits import TokenMask, process_logits
from strata.model.sampler import Sampler
from strata.types import RequestId

VOCAB = 64


def random_logits(rows: int, seed: int = 0) -> Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def history(rows: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=gen).tolist() for _ in range(rows)]


def run(logits: Tensor, params: list[SamplingParams], outputs: list[list[int]],
        prompts: list[list[int]] | None = None, eos: list[tuple[int, ...]] | None = None,
        mask: TokenMask | None = None) -> Tensor:
    """The processed logits (processing runs in place, on a copy here)."""
    n, out = len(params), logits.clone()
    process_logits(out, params, outputs, prompts or [[] for _ in range(n)],
                   eos or [() for _ in range(n)], mask)
    return out


def test_repetition_penalty_equals_hf_over_prompt_and_outputs() -> None:
    logits, prompts, outputs = random_logits(4), history(4, 12, 1), history(4, 5, 2)
    for penalty in (1.3, 0.7):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([p + o for p, o in zip(prompts, outputs, strict=True)]),
            logits.clone())
        got = run(logits, [SamplingParams(repetition_penalty=penalty)] * 4, outputs, prompts)
        torch.testing.assert_close(got, hf, rtol=0, atol=0)


def test_logit_bias_equals_hf_sequence_bias_of_single_tokens() -> None:
    logits = random_logits(2, seed=3)
    bias = ((5, 7.5), (9, -100.0), (63, 0.25))
    hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias])(
        torch.zeros((2, 1), dtype=torch.long), logits.clone())
    got = run(logits, [SamplingParams(logit_bias=bias)] * 2, [[], []])
    torch.testing.assert_close(got, hf, rtol=0, atol=0)


def test_min_tokens_equals_hf_min_new_tokens_while_short_then_lets_eos_through() -> None:
    logits, eos = random_logits(3, seed=4), (3, 7)
    params = [SamplingParams(min_tokens=4, stop_token_ids=(11,))] * 3
    outputs = [[1, 2], [1, 2, 3], [1, 2, 3, 4]]
    got = run(logits, params, outputs, eos=[eos] * 3)
    for row, produced in enumerate(outputs):
        hf = MinNewTokensLengthLogitsProcessor(0, 4, torch.tensor([*eos, 11]))(
            torch.tensor([produced]), logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], hf, rtol=0, atol=0)
    assert torch.isinf(got[0, [3, 7, 11]]).all() and torch.isfinite(got[2]).all()


def test_a_batch_equals_each_row_alone_and_rows_without_processors_are_untouched() -> None:
    logits, prompts, outputs = random_logits(6, seed=5), history(6, 9, 6), history(6, 4, 7)
    params = [SamplingParams(),
              SamplingParams(repetition_penalty=1.5, logit_bias=((2, 3.0),)),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(min_tokens=8),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, min_tokens=2),
              SamplingParams(logit_bias=((0, -5.0), (1, 5.0)))]
    eos = [(0,)] * 6
    batch = run(logits, params, outputs, prompts, eos)
    for row in range(6):
        alone = run(logits[row : row + 1], params[row : row + 1], outputs[row : row + 1],
                    prompts[row : row + 1], eos[row : row + 1])
        torch.testing.assert_close(batch[row : row + 1], alone, rtol=0, atol=0)
    assert torch.equal(batch[0], logits[0])
    assert not torch.equal(batch, logits)


def test_presence_and_frequency_count_outputs_only() -> None:
    logits = torch.zeros(1, VOCAB)
    got = run(logits, [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)],
              [[4, 4, 9]], prompts=[[1, 2, 3]])
    assert got[0, 4] == -2.0 and got[0, 9] == -1.5 and got[0, 1] == 0.0


def test_the_constraint_mask_wins_over_min_tokens() -> None:
    logits = random_logits(2, seed=8)
    only_eos = torch.zeros(2, VOCAB, dtype=torch.bool)
    only_eos[:, 3] = True
    only_eos[1, 20] = True
    for mask in (TokenMask(~only_eos), TokenMask(~only_eos, torch.tensor([0, 1]))):
        got = run(logits, [SamplingParams(min_tokens=5)] * 2, [[], []], eos=[(3,)] * 2,
                  mask=mask)
        assert torch.isfinite(got[0]).tolist() == only_eos[0].tolist()  # EOS kept: all left
        assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [20]  # EOS held back


def test_sampler_picks_inside_the_mask_greedy_and_sampled_with_raw_logprobs() -> None:
    logits = random_logits(3, seed=9)
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[:, 40:44] = True
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, seed=1)]
    for step in range(20):
        mask = TokenMask(~allowed, torch.tensor([0, 2]))  # row 1 is free
        tokens = Sampler(seed=step).sample(logits, params, [[0] * step] * 3, mask=mask)
        assert all(40 <= t.token_id < 44 for t in (tokens[0], tokens[2]))
    assert tokens[0].token_id == 40 + int(logits[0, 40:44].argmax())
    assert tokens[1].token_id == int(logits[1].argmax())
    lp = tokens[0].logprob
    assert lp is not None  # the raw model's log-probabilities, before the mask
    expected = torch.log_softmax(logits[0], dim=-1)
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-6)
    assert [t for t, _ in lp.top] == expected.topk(2).indices.tolist()


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5), ("min_tokens", -1),
    ("min_tokens", 17), ("logit_bias", ((1, 101.0),)),
])
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=16, **{field: value})  # type: ignore[arg-type]
    assert info.value.param == field


# --- through the engine, against HF generate ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("lp") / "m", initializer_range=0.2)
    return load_model(Path(path), dtype="float32"), Path(path)


def engine_of(model: LoadedModel) -> Engine:
    return Engine(TorchExecutor(model.config, model.weights, dtype="float32"),
                  CacheConfig(block_size=4, num_blocks=128),
                  SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128),
                  model.tokenizer, vocab_size=model.config.vocab_size)


PROMPTS = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (5, 19, 33)]


def test_greedy_with_repetition_penalty_and_min_tokens_equals_hf_generate(
        tiny: tuple[LoadedModel, Path]) -> None:
    model, path = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.tokenizer.eos_token_ids
    engine = engine_of(model)
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.4,
                            min_tokens=6)
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(RequestId(f"r{i}"), p, params, eos_token_ids=eos))
    got = run_to_completion(engine)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                              repetition_penalty=1.4, min_new_tokens=6, eos_token_id=list(eos),
                              pad_token_id=eos[0])
        expected = out[0, len(p):].tolist()
        expected = expected[: next((j + 1 for j, t in enumerate(expected) if t in eos),
                                   len(expected))]
        assert got[RequestId(f"r{i}")] == expected


def test_min_tokens_holds_back_eos_and_stop_strings(tiny: tuple[LoadedModel, Path]) -> None:
    model, _ = tiny
    engine = engine_of(model)
    first = engine_of(model)
    free = SamplingParams(max_tokens=8, temperature=0.0)
    first.add_request(Request(RequestId("a"), PROMPTS[0], free))
    leader = run_to_completion(first)[RequestId("a")][0]
    eos = (leader,)  # the token greedy would pick first counts as EOS here
    text = model.tokenizer.decode([leader])
    held = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3,
                          stop=(text,) if text.strip() else ())
    engine.add_request(Request(RequestId("b"), PROMPTS[0], held, eos_token_ids=eos))
    engine.add_request(Request(RequestId("c"), PROMPTS[0], free, eos_token_ids=eos))
    out = run_to_completion(engine)
    assert out[RequestId("c")] == [leader]  # without min_tokens, EOS ends it at once
    assert len(out[RequestId("b")]) >= 3 and leader not in out[RequestId("b")][:3]
