"""LoRA adapters on a parallel instance compute what one process computes with them (float32).

The nine-head tiny model (T=2 splits its heads 5 + 4 around a shared KV head, so both ranks
hold KV head 1 and its adapter rows) with two PEFT adapters (A: all seven modules, r=4; B: q,
v, down, r=8, rsLoRA): the 16 prompts of the parallel tests on the base, A and B by turns, in
one batch. T=2, and P=2 with its stages on two host ids (the adapters reach stage 1 over gloo),
give T=1's greedy tokens, logprobs within 1e-4 (bf16, the default dtype:
test_lora_parallel_bf16.py); the cuts themselves add up to the whole. An adapter removed from a
T=2 executor is gone on both ranks: a step that still names it fails on each, and the executor
goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bf16_rule import Run
from lora.parallel_lora import ADAPTERS, adapters, one_process, parallel, run_parallel

from strata.engine.executor import ModelInput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.errors import ShareFailedError
from strata.model.lora import LoraPair, sharded
from strata.model.parallel.comm import Host
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.launcher import MpRankLauncher
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import prepare_model
from strata.types import RequestId

pytestmark = pytest.mark.needs("shm")


@pytest.fixture(scope="module")
def reference(nine_head_loras: dict[str, Path]) -> list[Run]:
    got = one_process(nine_head_loras, "float32")
    base, *others = [{tuple(r.tokens) for r in got[i::3]} for i in range(len(ADAPTERS))]
    assert all(not base & o for o in others)  # each adapter changes every answer
    return got


@pytest.fixture(scope="module")
def tp2(nine_head_loras: dict[str, Path]) -> Iterator[ParallelExecutor]:
    executor = parallel(nine_head_loras, 2, 1, "float32")
    yield executor
    executor.shutdown()


def assert_same(got: list[Run], want: list[Run]) -> None:
    """Identical tokens, logprobs within 1e-4."""
    assert [g.tokens for g in got] == [w.tokens for w in want]
    for g, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4


def product(pair: LoraPair | None, x: torch.Tensor) -> torch.Tensor:
    assert pair is not None
    return (x @ pair.a.T) @ pair.b.T


def test_the_cuts_add_up_to_the_whole(nine_head_loras: dict[str, Path]) -> None:
    """T=2 x P=2: a rank's q/k/v (gate/up) rows are the whole's rows of its heads (MLP rows);
    its o (down) partial products sum over the stage to the whole's; other stages' layers are
    empty."""
    config = prepare_model(nine_head_loras["base"], dtype="float32", cache_dir=None).config
    (whole, _) = adapters(nine_head_loras, config)
    layout = ParallelLayout(2, 2)
    hd, q_all, kv_all = config.head_dim, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    x = torch.randn(3, config.hidden_size)
    for rank in range(layout.world_size):
        shard = layout.shard(rank, config)
        mine = sharded(whole, config, shard)
        q, kv = shard.q_heads, shard.kv_heads
        assert (q, kv) == ((range(0, 5), range(0, 2)) if rank % 2 == 0 else
                           (range(5, 9), range(1, 3)))  # KV head 1 on both
        for i, (w, m) in enumerate(zip(whole.layers, mine.layers, strict=True)):
            if i not in shard.layers:
                assert (m.qkv, m.o, m.gate_up, m.down) == (None, None, None, None)
                continue
            full = product(w.qkv, x)
            rows = [*range(q.start * hd, q.stop * hd),
                    *range(q_all + kv.start * hd, q_all + kv.stop * hd),
                    *range(q_all + kv_all + kv.start * hd, q_all + kv_all + kv.stop * hd)]
            torch.testing.assert_close(product(m.qkv, x), full[:, rows])
    for stage_ranks in ([0, 1], [2, 3]):
        cut = [sharded(whole, config, layout.shard(r, config)) for r in stage_ranks]
        shards = [layout.shard(r, config) for r in stage_ranks]
        i = shards[0].layers.start
        attn = torch.randn(3, config.num_attention_heads * hd)
        parts = [product(c.layers[i].o, attn[:, s.q_heads.start * hd: s.q_heads.stop * hd])
                 for c, s in zip(cut, shards, strict=True)]
        torch.testing.assert_close(parts[0] + parts[1], product(whole.layers[i].o, attn))
        act = torch.randn(3, config.intermediate_size)
        parts = [product(c.layers[i].down, act[:, s.intermediate.start: s.intermediate.stop])
                 for c, s in zip(cut, shards, strict=True)]
        torch.testing.assert_close(parts[0] + parts[1], product(whole.layers[i].down, act))
        gate_up = [product(c.layers[i].gate_up, x) for c in cut]
        full = product(whole.layers[i].gate_up, x)
        gates = [g[:, : len(s.intermediate)] for g, s in zip(gate_up, shards, strict=True)]
        ups = [g[:, len(s.intermediate):] for g, s in zip(gate_up, shards, strict=True)]
        torch.testing.assert_close(torch.cat(gates + ups, 1), full)  # [gate | up] of the whole


def test_t2_with_adapters_is_identical_to_t1(tp2: ParallelExecutor,
                                             nine_head_loras: dict[str, Path],
                                             reference: list[Run]) -> None:
    assert_same(run_parallel(tp2, nine_head_loras), reference)


def test_p2_on_two_hosts_with_adapters_is_identical_to_t1(nine_head_loras: dict[str, Path],
                                                          reference: list[Run]) -> None:
    """Stage 1 on "another host" (the same machine under another host id, as
    test_pipeline_ranks.py does): the adapters reach it over gloo, as over a Ray cluster."""
    hosts = [Host("a", "127.0.0.1"), Host("b", "127.0.0.1")]
    executor = parallel(nine_head_loras, 1, 2, "float32", launcher=MpRankLauncher(hosts=hosts))
    try:
        assert executor.comm_spec.world_backend == "gloo"
        assert_same(run_parallel(executor, nine_head_loras), reference)
    finally:
        executor.shutdown()


def test_a_removed_adapter_is_gone_on_every_rank(tp2: ParallelExecutor,
                                                 nine_head_loras: dict[str, Path]) -> None:
    (a, _) = adapters(nine_head_loras, tp2.config)
    digest = tp2.add_lora(a)
    tp2.allocate_kv_cache(16, 4)
    seq = ScheduledSequence(RequestId("x"), [5, 6, 7], 0, [0], True,
                            SamplingParams(temperature=0.0), [], [5, 6, 7],
                            lora_name="a", lora_digest=digest)
    assert len(tp2.execute(ModelInput([seq], 4))) == 1
    tp2.remove_lora(digest)
    assert not tp2.has_lora(digest)
    with pytest.raises(ShareFailedError, match="lora_loaded") as failed:
        tp2.execute(ModelInput([seq], 4))
    assert failed.value.ranks == (0, 1)  # each rank found it gone
    assert tp2.is_alive()
    assert tp2.add_lora(a) == digest and len(tp2.execute(ModelInput([seq], 4))) == 1
