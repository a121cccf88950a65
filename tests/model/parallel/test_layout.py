"""ParallelLayout: who holds which heads, rows and layers; refusals name the sizes that work."""

from __future__ import annotations

import pytest

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.parallel.layout import ParallelLayout, RankCoords, even_split
from strata.model.shard import RankShard

SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True)


def test_even_split_gives_the_remainder_to_the_first_parts() -> None:
    assert even_split(9, 2) == [range(0, 5), range(5, 9)]
    assert even_split(9, 3) == [range(0, 3), range(3, 6), range(6, 9)]
    assert even_split(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]


def test_t2_splits_9_heads_5_plus_4_and_both_ranks_hold_the_shared_kv_head() -> None:
    layout = ParallelLayout(tensor_size=2)
    layout.validate(SMOLLM2)
    first, second = layout.shard(0, SMOLLM2), layout.shard(1, SMOLLM2)
    assert (first.q_heads, first.kv_heads) == (range(0, 5), range(0, 2))
    assert (second.q_heads, second.kv_heads) == (range(5, 9), range(1, 3))
    # KV head 1 serves global heads 3, 4 (rank 0) and 5 (rank 1).
    assert first.head_start == (0, 3, 5)
    assert second.head_start == (0, 1, 4)
    assert not first.is_uniform and not second.is_uniform
    assert first.intermediate == range(0, 768) and second.intermediate == range(768, 1536)
    assert first.vocab == range(0, 24576) and second.vocab == range(24576, 49152)
    assert first.layers == second.layers == range(30)
    assert first.is_first_stage and first.is_last_stage


def test_t3_splits_evenly_one_kv_head_each() -> None:
    layout = ParallelLayout(tensor_size=3)
    shards = [layout.shard(r, SMOLLM2) for r in range(3)]
    assert [(s.q_heads, s.kv_heads) for s in shards] == [
        (range(0, 3), range(0, 1)), (range(3, 6), range(1, 2)), (range(6, 9), range(2, 3))]
    assert all(s.head_start == (0, 3) and s.is_uniform for s in shards)
    assert [s.vocab for s in shards] == even_split(49152, 3)


def test_t2_x_p2_numbers_ranks_stage_major_and_samples_on_the_last_stage() -> None:
    layout = ParallelLayout(tensor_size=2, pipeline_size=2)
    assert layout.world_size == 4 and layout.name == "tp2xpp2"
    assert [layout.coords(r) for r in range(4)] == [
        RankCoords(0, 0), RankCoords(0, 1), RankCoords(1, 0), RankCoords(1, 1)]
    assert layout.stage_ranks(1) == [2, 3] and layout.sampling_rank == 2
    shard = layout.shard(3, SMOLLM2)
    assert shard.layers == range(15, 30) and shard.q_heads == range(5, 9)
    assert not shard.is_first_stage and shard.is_last_stage
    assert layout.shard(0, SMOLLM2).is_first_stage and not layout.shard(0, SMOLLM2).is_last_stage


def test_pipeline_layers_override_the_even_split() -> None:
    layout = ParallelLayout(pipeline_size=2, pipeline_layers=(10, 20))
    layout.validate(SMOLLM2)
    assert layout.stage_layers(SMOLLM2) == [range(0, 10), range(10, 30)]
    assert layout.name == "pp2"


def test_the_whole_model_is_one_full_shard() -> None:
    shard = ParallelLayout().shard(0, SMOLLM2)
    assert shard == RankShard.full(SMOLLM2) and shard.is_full(SMOLLM2)
    assert shard.head_start == (0, 3, 6, 9) and shard.is_uniform
    assert ParallelLayout().name == "tp1"


@pytest.mark.parametrize(("layout", "message"), [
    (dict(tensor_size=10), r"--tensor-parallel-size 10 cannot split the model's 9 attention "
                           r"heads .*valid sizes: 1 \.\. 9"),
    (dict(pipeline_size=31), r"--pipeline-parallel-size 31 cannot split the model's 30 layers"
                             r".*valid sizes: 1 \.\. 30"),
    (dict(pipeline_size=2, pipeline_layers=(10, 10)), r"add up to 20, .* 30 layers; e\.g\. 15,15"),
])
def test_a_size_that_cannot_work_is_refused_with_the_sizes_that_can(
        layout: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelLayout(**layout).validate(SMOLLM2)


def test_malformed_layouts_are_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        ParallelLayout(tensor_size=0)
    with pytest.raises(ConfigError, match="one number per stage"):
        ParallelLayout(pipeline_size=2, pipeline_layers=(30,))


def test_a_tiny_model_lists_every_valid_size() -> None:
    tiny = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                       head_dim=16, max_position_embeddings=256)
    with pytest.raises(ConfigError, match="valid sizes: 1, 2, 3$"):
        ParallelLayout(tensor_size=4).validate(tiny)
