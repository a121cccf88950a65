"""Pooling requests (embeddings) in the engine: the scheduler batches whole inputs, never
chunks one, the executor's `Pooled` vector is the request's only output, and the request frees
its blocks at once (no KV is kept). A fake executor pools by summing the tokens it read."""

from __future__ import annotations

import dataclasses

import pytest
from engine_fakes import FakeExecutor, make_engine, make_request, prompt_of

from strata.engine.executor import ModelInput, ModelOutput, Pooled
from strata.engine.request import FinishReason, Request
from strata.errors import ContextLengthError, InvalidRequestError


class PoolingFake(FakeExecutor):
    """Pools a pooling sequence into [sum of its tokens, its length]; samples the others."""

    def execute(self, model_input: ModelInput) -> ModelOutput:
        out = super().execute(model_input)
        for seq in model_input.sequences:
            if seq.is_pooling:
                assert seq.start_pos == 0 and seq.needs_sample, "a pooling input ran in chunks"
                out[seq.request_id] = Pooled([float(sum(seq.token_ids)), len(seq.token_ids)])
        return out


def pooling(prompt: list[int], request_id: str) -> Request:
    return dataclasses.replace(make_request(prompt, 1, request_id=request_id), is_pooling=True)


def test_pooling_requests_run_whole_in_one_batch_and_end_with_their_vector() -> None:
    engine, executor = make_engine(executor=PoolingFake(), enable_prefix_caching=False,
                                   enable_chunked_prefill=False, max_num_batched_tokens=64,
                                   max_model_len=64)
    prompts = {"a": prompt_of(10), "b": prompt_of(30, start=3), "c": prompt_of(30, start=5)}
    for rid, prompt in prompts.items():
        engine.add_request(pooling(prompt, rid))
    first = engine.step()  # a (10) and b (30) fit the 64-token budget; c (30) would not
    assert executor.num_tokens_per_step == [40]
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in first] == \
        [("a", True, FinishReason.STOP, []), ("b", True, FinishReason.STOP, [])]
    assert first[0].embedding == [float(sum(prompts["a"])), 10.0]
    assert first[1].num_prompt_tokens == 30 and first[1].num_output_tokens == 0
    assert engine.stats().num_free_blocks == engine.cache_config.num_blocks  # nothing kept
    second = engine.step()
    assert [(o.request_id, o.embedding) for o in second] == \
        [("c", [float(sum(prompts["c"])), 30.0])]
    assert executor.num_tokens_per_step == [40, 30]
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_a_pooling_input_is_never_chunked_even_with_chunked_prefill_on() -> None:
    engine, executor = make_engine(executor=PoolingFake(), enable_prefix_caching=False,
                                   max_num_batched_tokens=32, max_model_len=128)
    engine.add_request(pooling(prompt_of(20), "first"))
    engine.add_request(pooling(prompt_of(20, start=2), "second"))  # 12 would fit: not a part
    assert [o.request_id for o in engine.step()] == ["first"]
    assert [o.request_id for o in engine.step()] == ["second"]
    assert executor.num_tokens_per_step == [20, 20]
    with pytest.raises(ContextLengthError, match="step token budget is 32 tokens"):
        engine.validate_request(pooling(prompt_of(40), "never-runs-whole"))


def test_the_engine_refuses_what_an_encoder_cannot_read() -> None:
    engine, _ = make_engine(executor=PoolingFake(), enable_prefix_caching=False,
                            max_model_len=64)
    engine.validate_request(pooling(prompt_of(64), "fits"))  # all positions, nothing to generate
    with pytest.raises(ContextLengthError, match="maximum input length is 64 tokens"):
        engine.validate_request(pooling(prompt_of(65), "long"))
    cached, _ = make_engine(executor=PoolingFake())
    with pytest.raises(InvalidRequestError, match="without prefix caching"):
        cached.validate_request(pooling(prompt_of(8), "x"))
