"""KV offload in the pure engine: fetched blocks imported at admission, full blocks exported at
the end. The fake executor's 'KV' is token ids read back through the block table, so an import
into the wrong block, or a block counted as computed but never written, changes the tokens.
Every story runs with a plain executor and with two pipeline stages (batches in flight)."""

from __future__ import annotations

import pytest
from engine_fakes import (
    KVFakeExecutor,
    KVPipelineFakeExecutor,
    KVTransferFake,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.outputs import RequestOutput
from strata.engine.request import Request
from strata.types import BlockHash

BLOCK = 4
KVFake = type[KVTransferFake]


@pytest.fixture(params=[KVFakeExecutor, KVPipelineFakeExecutor], ids=["plain", "pipeline2"])
def kv_fake(request: pytest.FixtureRequest) -> KVFake:
    return request.param  # type: ignore[no-any-return]


def engine(kv_fake: KVFake, namespace: str = "m@1") -> tuple[Engine, KVTransferFake]:
    executor = kv_fake()
    return Engine(executor, CacheConfig(block_size=BLOCK, num_blocks=64, namespace=namespace),
                  SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                  _Decoder(), vocab_size=64), executor


class _Decoder:
    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return ""


def run_one(eng: Engine, request: Request) -> tuple[list[int], RequestOutput]:
    eng.add_request(request)
    outputs: list[RequestOutput] = []
    while eng.has_unfinished_requests():
        outputs += eng.step()
        eng.check_integrity()
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


PROMPT = prompt_of(18)  # 4 full blocks + 2 tokens


def first_turn(
    kv_fake: KVFake, namespace: str = "m@1"
) -> tuple[list[int], list[tuple[BlockHash, bytes]]]:
    """Engine A answers PROMPT (3 tokens) and exports its 5 computed full blocks."""
    eng, executor = engine(kv_fake, namespace)
    tokens, last = run_one(eng, make_request_with(PROMPT, 3, kv_export=True))
    assert executor.exports == [[0, 1, 2, 3, 4]]  # 18 + 3 - 1 = 20 computed tokens
    assert [h for h, _ in last.kv_blocks] == eng.block_hashes(PROMPT + tokens)[:5]
    return tokens, last.kv_blocks


def make_request_with(prompt: list[int], max_tokens: int, **fields: object) -> Request:
    request = make_request(prompt, max_tokens)
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def test_fetched_blocks_are_imported_into_new_blocks_counted_and_cached(kv_fake: KVFake) -> None:
    answer, blocks = first_turn(kv_fake)
    prompt2 = PROMPT + answer + prompt_of(6, start=5)  # the next turn: 27 tokens
    eng, executor = engine(kv_fake)
    tokens, last = run_one(eng, make_request_with(prompt2, 4, external_kv=dict(blocks)))
    assert executor.imports == [[0, 1, 2, 3, 4]]
    assert tokens == reference_tokens(prompt2, 4)
    assert last.num_cached_tokens == 20
    stats = eng.stats()
    assert (stats.num_external_hit_tokens, stats.prefix_cache_hits) == (20, 0)
    assert stats.num_prompt_tokens == 7  # only the tokens after the fetched prefix ran
    hashes = eng.block_hashes(prompt2)
    assert [eng.kv.pool.cached[h].block_id for h in hashes[:5]] == [0, 1, 2, 3, 4]
    # the imported blocks now serve a local prefix hit
    again, last = run_one(eng, make_request(prompt2, 4))
    assert again == tokens and last.num_cached_tokens == 24
    assert executor.imports == [[0, 1, 2, 3, 4]]


def test_local_hits_come_first_and_only_the_rest_is_imported(kv_fake: KVFake) -> None:
    answer, blocks = first_turn(kv_fake)
    eng, executor = engine(kv_fake)
    run_one(eng, make_request(PROMPT[:9], 1))  # caches blocks 0 and 1 locally (ids 0, 1)
    prompt2 = PROMPT + answer + [7]
    tokens, last = run_one(eng, make_request_with(prompt2, 3, external_kv=dict(blocks)))
    assert executor.imports == [[3, 4, 5]]  # new blocks come from the free queue's head
    assert tokens == reference_tokens(prompt2, 3)
    assert last.num_cached_tokens == 20
    assert (eng.stats().prefix_cache_hits, eng.stats().num_external_hit_tokens) == (8, 12)


def test_a_refused_payload_and_those_after_it_are_recomputed(kv_fake: KVFake) -> None:
    answer, blocks = first_turn(kv_fake)
    blocks[2] = (blocks[2][0], b"corrupt")
    prompt2 = PROMPT + answer + [9]
    eng, executor = engine(kv_fake)
    tokens, last = run_one(eng, make_request_with(prompt2, 3, external_kv=dict(blocks)))
    assert executor.imports == [[0, 1, 2, 3, 4]]
    assert tokens == reference_tokens(prompt2, 3)
    assert last.num_cached_tokens == 8
    stats = eng.stats()
    assert (stats.num_kv_import_failures, stats.num_external_hit_tokens) == (1, 8)


def test_blocks_of_another_version_are_never_used(kv_fake: KVFake) -> None:
    answer, blocks = first_turn(kv_fake, namespace="m@2")
    prompt2 = PROMPT + answer + [9]
    eng, executor = engine(kv_fake, namespace="m@1")
    tokens, last = run_one(eng, make_request_with(prompt2, 3, external_kv=dict(blocks)))
    assert executor.imports == []
    assert last.num_cached_tokens == 0
    assert tokens == reference_tokens(prompt2, 3)


def test_export_skips_blocks_known_to_be_stored(kv_fake: KVFake) -> None:
    eng, executor = engine(kv_fake)
    tokens, last = run_one(eng, make_request_with(PROMPT, 3, kv_export=True,
                                                  kv_export_start_block=3))
    assert executor.exports == [[3, 4]]
    assert [h for h, _ in last.kv_blocks] == eng.block_hashes(PROMPT + tokens)[3:5]


def test_no_export_without_the_flag_and_none_on_abort(kv_fake: KVFake) -> None:
    eng, executor = engine(kv_fake)
    _, last = run_one(eng, make_request(PROMPT, 3))
    assert last.kv_blocks == [] and executor.exports == []
    request = make_request_with(PROMPT, 50, kv_export=True)
    eng.add_request(request)
    eng.step()
    eng.abort_request(request.request_id)
    assert run_to_completion(eng) == {} and executor.exports == []
