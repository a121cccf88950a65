"""Resumed requests: a request that arrives with the tokens another engine generated goes on
exactly as that engine would have (token ids, released text, stop strings across the hand-over,
usage counts), and one that had already ended is refused."""

from __future__ import annotations

import pytest
from engine_fakes import (
    ALPHABET,
    EOS,
    FakeDecoder,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
)

from strata.engine.detokenizer import final_text, released_text
from strata.engine.engine import Engine
from strata.engine.outputs import RequestOutput
from strata.engine.request import FinishReason, Request
from strata.errors import InvalidRequestError


def outputs_of(engine: Engine, request: Request) -> list[RequestOutput]:
    engine.add_request(request)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == request.request_id)
        engine.check_integrity()
    return outs


def resumed(request: Request, sent: list[int]) -> Request:
    again = make_request(request.prompt_token_ids, request.sampling_params.max_tokens,
                         **_params(request))
    again.output_token_ids = list(sent)
    return again


def _params(request: Request) -> dict[str, object]:
    p = request.sampling_params
    return {"temperature": p.temperature, "seed": p.seed, "stop": p.stop,
            "logprobs": p.logprobs}


@pytest.mark.parametrize("num_sent", [1, 5, 11])
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_token_for_token(num_sent: int, seed: int | None) -> None:
    prompt = prompt_of(9)
    params: dict[str, object] = {"temperature": 0.9, "seed": seed} if seed else {}
    whole = outputs_of(make_engine()[0], make_request(prompt, 12, **params))
    tokens = [t for o in whole for t in o.new_token_ids]
    assert tokens == reference_tokens(prompt, 12, seed)
    engine, executor = make_engine()
    rest = outputs_of(engine, resumed(make_request(prompt, 12, **params), tokens[:num_sent]))
    assert [t for o in rest for t in o.new_token_ids] == tokens[num_sent:]
    last = rest[-1]
    assert (last.num_prompt_tokens, last.num_output_tokens) == (9, 12)
    assert last.finish_reason == FinishReason.LENGTH
    assert executor.num_tokens_per_step[0] == 9 + num_sent  # prompt and sent tokens prefilled


def test_a_stop_string_across_the_hand_over_is_found_and_no_text_is_sent_twice() -> None:
    prompt = prompt_of(5)
    tokens = reference_tokens(prompt, 16)
    text = "".join(ALPHABET[t] for t in tokens)
    stop = text[6:10]  # four tokens: text is held back three characters at a time
    whole = outputs_of(make_engine()[0], make_request(prompt, 16, stop=(stop,)))
    streamed = "".join(o.new_text for o in whole)
    assert streamed == text[:6]
    for num_sent in range(1, 9):  # every cut before, inside and right after the stop string
        first = make_request(prompt, 16, stop=(stop,))
        first.output_token_ids = tokens[:num_sent]
        before = released_text(FakeDecoder(), first)
        rest = outputs_of(make_engine()[0], resumed(first, tokens[:num_sent]))
        assert before + "".join(o.new_text for o in rest) == streamed, num_sent
        assert rest[-1].stop_reason == stop and rest[-1].finish_reason == FinishReason.STOP
        assert rest[-1].num_output_tokens == whole[-1].num_output_tokens


def test_usage_counts_cached_tokens_of_the_prompt_only() -> None:
    prompt = prompt_of(12)
    tokens = reference_tokens(prompt, 10)
    engine, _ = make_engine(block_size=4)
    outputs_of(engine, make_request(prompt + tokens[:8], 1))  # caches prompt and outputs
    rest = outputs_of(engine, resumed(make_request(prompt, 10), tokens[:8]))
    assert [t for o in rest for t in o.new_token_ids] == tokens[8:]
    assert rest[-1].num_cached_tokens == 12


@pytest.mark.parametrize("case", ["max_tokens", "eos", "stop_token", "stop_string", "vocab"])
def test_a_request_that_had_ended_is_refused(case: str) -> None:
    prompt = prompt_of(5)
    tokens = reference_tokens(prompt, 8)
    request = make_request(prompt, 8)
    request.output_token_ids = tokens[:3]
    if case == "max_tokens":
        request.output_token_ids = tokens
    elif case == "eos":
        request.output_token_ids = [*tokens[:2], EOS]
    elif case == "stop_token":
        request = make_request(prompt, 8, stop_token_ids=(tokens[1],))
        request.output_token_ids = tokens[:3]
    elif case == "stop_string":
        request = make_request(prompt, 8, stop=(ALPHABET[tokens[1]],))
        request.output_token_ids = tokens[:3]
    else:
        request.output_token_ids = [1, 10_000]
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(request)
    assert refused.value.param == "output_token_ids"
    assert not engine.has_unfinished_requests()


def test_final_text_is_what_the_finished_stream_sent() -> None:
    prompt = prompt_of(5)
    tokens = reference_tokens(prompt, 12)
    text = "".join(ALPHABET[t] for t in tokens)
    by_string = make_request(prompt, 12, stop=(text[4:6],))
    by_string.output_token_ids = tokens[:6]
    assert final_text(FakeDecoder(), by_string, stopped_by_token=False) == text[:4]
    by_token = make_request(prompt, 12)
    by_token.output_token_ids = tokens[:5]
    assert final_text(FakeDecoder(), by_token, stopped_by_token=True) == text[:4]
    by_length = make_request(prompt, 12, stop=("zz",))
    by_length.output_token_ids = tokens
    assert final_text(FakeDecoder(), by_length, stopped_by_token=False) == text
