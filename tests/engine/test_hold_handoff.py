"""Prefill/decode hand-off in the pure engine: a finished request's blocks held until released,
and a request that gets its first token from the prefill side.

The fake executor's 'KV' is the token ids read back through the block table (engine_fakes), so a
held block handed out again, or an import into the wrong block, changes the tokens.
"""

from __future__ import annotations

from array import array

import pytest
from engine_fakes import (
    FakeExecutor,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.outputs import RequestOutput
from strata.engine.request import Handoff, Logprob, Request
from strata.types import RequestId

BLOCK = 4
TAG = b"kv:"


class KVExecutor(FakeExecutor):
    """Exports a block as its token ids; imports only payloads it exported."""

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [TAG + array("q", [-1 if t is None else t
                                  for t in self.slots[b * BLOCK : (b + 1) * BLOCK]]).tobytes()
                for b in block_ids]

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> int:
        for i, (block_id, payload) in enumerate(zip(block_ids, payloads, strict=True)):
            if not payload.startswith(TAG):
                return i
            self.slots[block_id * BLOCK : (block_id + 1) * BLOCK] = array(
                "q", payload[len(TAG):]).tolist()
        return len(payloads)


def kv_engine(num_blocks: int = 64) -> tuple[Engine, KVExecutor]:
    executor = KVExecutor()
    engine = Engine(executor, CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                                          namespace="m@1"),
                    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                    _Decoder(), vocab_size=64)
    return engine, executor


class _Decoder:
    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return ""


def run_one(engine: Engine, request: Request) -> tuple[list[int], RequestOutput]:
    engine.add_request(request)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        engine.check_integrity()
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


def holding(prompt: list[int], max_tokens: int = 1, **params: object) -> Request:
    request = make_request(prompt, max_tokens, **params)
    request.hold_blocks = True
    return request


PROMPT = prompt_of(10)  # 2 full blocks + 2 tokens


def test_a_finished_request_holds_its_prompt_blocks_until_released() -> None:
    engine, _ = make_engine(num_blocks=16)
    _, last = run_one(engine, holding(PROMPT))
    assert last.held is not None
    assert last.held.block_ids == (0, 1, 2)  # block 2 holds the partial tail (2 tokens)
    assert list(last.held.block_hashes) == engine.block_hashes(PROMPT, partial=True)
    assert list(last.held.block_hashes[:2]) == engine.block_hashes(PROMPT)
    assert engine.stats().num_held_blocks == 3
    assert engine.kv.pool.num_free_blocks == 13
    assert engine.release_held(last.request_id) == 3
    engine.check_integrity()
    assert engine.kv.pool.num_free_blocks == 16 and engine.stats().num_held_blocks == 0
    assert engine.kv.pool.free_queue.block_ids()[-3:] == [2, 1, 0]  # the tail goes first
    assert engine.release_held(last.request_id) == 0  # released once


def test_held_blocks_are_never_handed_out_nor_evicted() -> None:
    engine, _ = make_engine(num_blocks=8)
    _, last = run_one(engine, holding(PROMPT))
    assert engine.reset_prefix_cache() == 0  # held blocks are not evictable
    other = make_request(prompt_of(17, start=3), 3)  # needs 5 blocks: every free one
    engine.add_request(other)
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    assert last.held is not None
    assert set(engine.kv.block_ids(other.request_id)).isdisjoint(last.held.block_ids)
    assert engine.kv.pool.num_free_blocks == 0
    tokens += run_to_completion(engine)[other.request_id]
    assert tokens == reference_tokens(other.prompt_token_ids, 3)


def test_held_blocks_serve_prefix_hits_and_outlive_a_sharer() -> None:
    engine, _ = make_engine(num_blocks=16)
    _, first = run_one(engine, holding(PROMPT))
    tokens, again = run_one(engine, make_request(PROMPT + [5, 6], 2))
    assert again.num_cached_tokens == 8 and tokens == reference_tokens(PROMPT + [5, 6], 2)
    assert engine.kv.pool.blocks[0].ref_cnt == 1  # the hold alone, after the sharer finished
    engine.release_held(first.request_id)
    engine.check_integrity()


def test_no_hold_on_abort_or_without_the_flag() -> None:
    engine, _ = make_engine(num_blocks=16)
    _, last = run_one(engine, make_request(PROMPT, 1))
    assert last.held is None
    request = holding(PROMPT, max_tokens=5)
    engine.add_request(request)
    engine.step()
    engine.abort_request(request.request_id)
    run_to_completion(engine)
    assert engine.stats().num_held_blocks == 0 and engine.kv.pool.num_free_blocks == 16


def test_export_reads_held_blocks() -> None:
    engine, executor = kv_engine()
    _, last = run_one(engine, holding(PROMPT))
    assert last.held is not None
    payloads = executor.export_blocks(list(last.held.block_ids))  # held: never written
    assert [array("q", p[len(TAG):]).tolist() for p in payloads] == [
        PROMPT[:4], PROMPT[4:8], PROMPT[8:] + [-1, -1]]  # the tail's last slots: never written


def test_the_handed_first_token_is_appended_instead_of_a_sample() -> None:
    engine, _ = make_engine()
    handed = Logprob(token_id=11, logprob=-0.25, top=[(11, -0.25), (3, -2.0)])
    request = make_request(PROMPT, 4, logprobs=1)
    request.handoff = Handoff(11, handed, num_cached_tokens=4)
    engine.add_request(request)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens[0] == 11 and outputs[0].new_logprobs == [handed]
    assert tokens[1:] == reference_tokens(PROMPT + [11], 3)  # decoding goes on from it
    assert outputs[-1].num_cached_tokens == 4  # what the prefill side's prefix cache served


def prefill_then_decode(prompt: list[int], max_tokens: int, damage_block: int | None = None,
                        **params: object) -> tuple[list[int], Engine]:
    """P holds and exports the prompt's blocks with its first token; D imports them with the
    hand-off. Returns D's tokens and D."""
    prefill, prefill_executor = kv_engine()
    first_tokens, done = run_one(prefill, holding(prompt, 1, **params))
    assert done.held is not None and len(done.held) == -(-len(prompt) // BLOCK)
    payloads = prefill_executor.export_blocks(list(done.held.block_ids))
    if damage_block is not None:
        payloads[damage_block] = b"damaged"
    prefill.release_held(done.request_id)
    assert prefill.kv.pool.num_free_blocks == 64 and prefill.stats().num_held_blocks == 0
    decode, _ = kv_engine()
    request = make_request(prompt, max_tokens, **params)
    request.external_kv = dict(zip(done.held.block_hashes, payloads, strict=True))
    request.handoff = Handoff(first_tokens[0], num_cached_tokens=done.num_cached_tokens)
    tokens, _ = run_one(decode, request)
    return tokens, decode


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("length", [17, 16], ids=["partial-tail", "whole-blocks"])
def test_a_hand_off_equals_one_engine_and_computes_no_prompt_token(seed: int | None,
                                                                   length: int) -> None:
    prompt = prompt_of(length)
    params = {"temperature": 0.8, "seed": seed} if seed is not None else {}
    mixed, _ = kv_engine()
    expected, _ = run_one(mixed, make_request(prompt, 6, **params))
    tokens, decode = prefill_then_decode(prompt, 6, **params)
    assert tokens == expected
    stats = decode.stats()
    assert stats.num_prompt_tokens == 0  # P's KV for every prompt position, the tail's too
    assert (stats.num_external_hit_tokens, stats.num_generated_tokens) == (length, 6)


def test_a_refused_tail_is_recomputed_and_the_handed_token_still_used() -> None:
    prompt = prompt_of(17)
    mixed, _ = kv_engine()
    expected, _ = run_one(mixed, make_request(prompt, 4))
    tokens, decode = prefill_then_decode(prompt, 4, damage_block=4)
    assert tokens == expected
    stats = decode.stats()
    assert (stats.num_prompt_tokens, stats.num_kv_import_failures) == (1, 1)
    assert stats.num_external_hit_tokens == 16


def test_a_handed_request_with_a_local_prompt_hit_decodes_at_once() -> None:
    prompt = prompt_of(16)
    engine, _ = kv_engine()
    run_one(engine, make_request(prompt + [1], 1))  # caches the prompt's 4 blocks
    request = make_request(prompt, 3)
    request.handoff = Handoff(reference_tokens(prompt, 1)[0])
    tokens, last = run_one(engine, request)
    assert tokens == reference_tokens(prompt, 3)
    assert engine.stats().num_prompt_tokens == 17  # the first request's prompt only


def test_one_hold_per_request() -> None:
    engine, _ = make_engine()
    request = holding(PROMPT)
    run_one(engine, request)
    with pytest.raises(RuntimeError, match="one_hold_per_request"):
        engine.kv.hold_finished(request)
    assert engine.release_held(RequestId("unknown")) == 0
