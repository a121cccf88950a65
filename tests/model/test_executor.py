"""TorchExecutor's contract: weights checked at load, KV sizing, what `execute` returns, and
that padding and unused slots never leak into results."""

from __future__ import annotations

import pytest
import torch
from model.test_llama_parity import (
    GREEDY,
    forward_logits,
    make_executor,
    prompts,
    run_greedy,
    tiny_hf_model,
)

from strata.engine.executor import ModelInput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.errors import ConfigError, ModelLoadError
from strata.model.executor import TorchExecutor
from strata.model.gemm import PackedWeight
from strata.model.hf_config import model_config_from_hf
from strata.types import RequestId


def seq(rid: str, tokens: list[int], start: int, blocks: list[int], needs_sample: bool = True,
        params: SamplingParams = GREEDY, outputs: list[int] | None = None) -> ScheduledSequence:
    return ScheduledSequence(RequestId(rid), tokens, start, blocks, needs_sample, params,
                             outputs or [], tokens)


def test_kv_sizing_and_attributes() -> None:
    hf = tiny_hf_model("llama")
    config = model_config_from_hf(hf.config.to_dict())
    executor = TorchExecutor(config, hf.state_dict())
    assert (executor.dtype, executor.device, executor.vocab_size) == ("bfloat16", "cpu", 256)
    # 2 layers x (K and V) x 2 kv heads x head_dim 16 x 2 bytes
    assert executor.kv_bytes_per_token() == 256
    executor.allocate_kv_cache(num_blocks=10, block_size=4)
    assert executor.kv_cache is not None
    assert executor.kv_cache.data.shape == (2, 2, 41, 2, 16)  # 40 slots + the null slot
    assert executor.kv_cache.data[:, :, 40].abs().sum() == 0


def test_missing_and_misshaped_weights_name_the_tensor() -> None:
    hf = tiny_hf_model("qwen2")
    config = model_config_from_hf(hf.config.to_dict())
    weights = dict(hf.state_dict())
    del weights["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.self_attn.k_proj.bias' is missing"
                       r" \(expected shape \[32\]\)"):
        TorchExecutor(config, weights)
    weights = dict(hf.state_dict())
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 128)
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.up_proj.weight' has shape "
                       r"\[64, 128\], expected \[128, 64\]"):
        TorchExecutor(config, weights)


def test_tied_model_needs_no_lm_head_and_untied_does() -> None:
    tied = tiny_hf_model("llama_tied_rope3")
    weights = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    TorchExecutor(model_config_from_hf(tied.config.to_dict()), weights)
    untied = tiny_hf_model("llama")
    weights = {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ModelLoadError, match="'lm_head.weight' is missing"):
        TorchExecutor(model_config_from_hf(untied.config.to_dict()), weights)


def test_unknown_dtype_is_a_config_error() -> None:
    hf = tiny_hf_model("llama")
    with pytest.raises(ConfigError, match="dtype 'fp8' is not supported"):
        TorchExecutor(model_config_from_hf(hf.config.to_dict()), hf.state_dict(), dtype="fp8")


def test_execute_returns_exactly_the_sequences_that_need_a_sample() -> None:
    executor = make_executor(tiny_hf_model("llama"))
    a, b = prompts((9, 6))
    out = executor.execute(ModelInput([seq("a", a, 0, [5, 2, 7], needs_sample=False),
                                       seq("b", b, 0, [0, 1])], block_size=4))
    assert list(out) == ["b"]
    assert out["b"].logprob is None
    assert executor.execute(ModelInput([], block_size=4)) == {}


def test_execute_refuses_a_block_table_that_does_not_cover_the_tokens() -> None:
    executor = make_executor(tiny_hf_model("llama"))
    with pytest.raises(RuntimeError, match="block_table_covers_tokens"):
        executor.execute(ModelInput([seq("a", list(range(9)), 0, [3, 4])], block_size=4))


def test_garbage_in_unused_slots_never_reaches_the_results() -> None:
    """Decode rows of different lengths pad their gathers; padding must read the null slot."""
    hf = tiny_hf_model("llama")
    token_lists = prompts()
    expected = run_greedy(make_executor(hf), token_lists, num_new=6)
    poisoned = make_executor(hf)
    assert poisoned.kv_cache is not None
    null = poisoned.kv_cache.null_slot
    poisoned.kv_cache.data[:, :, :null] = float("nan")
    assert run_greedy(poisoned, token_lists, num_new=6) == expected


def test_prefix_hit_reads_blocks_written_by_another_sequence() -> None:
    """B shares A's first two blocks (8 tokens) and computes only its own tail."""
    hf = tiny_hf_model("llama")
    shared, tail_a, tail_b = prompts((8, 5, 7))
    executor = make_executor(hf)
    executor.execute(ModelInput([seq("a", shared + tail_a, 0, [9, 4, 12, 30])], block_size=4))
    hit = forward_logits(executor, [seq("b", tail_b, 8, [9, 4, 21, 6])])
    fresh = forward_logits(make_executor(hf), [seq("b", shared + tail_b, 0, [0, 1, 2, 3])])
    torch.testing.assert_close(hit, fresh, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_through_execute_ignores_the_batch() -> None:
    hf = tiny_hf_model("llama")
    prompt, other = prompts((11, 5))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = make_executor(hf).execute(
        ModelInput([seq("s", prompt, 0, [3, 8, 1], params=seeded, outputs=[4, 5])], 4))
    batched = make_executor(hf).execute(ModelInput([
        seq("o", other, 0, [0, 2], params=SamplingParams(temperature=1.0)),
        seq("s", prompt, 0, [3, 8, 1], params=seeded, outputs=[4, 5]),
    ], 4))
    assert batched["s"].token_id == alone["s"].token_id


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_shares_no_storage_with_the_loaders_weights(dtype: str) -> None:
    """Loader tensors may be views of one mmap of the file: a kept view pins all of it."""
    hf = tiny_hf_model("llama")
    weights = {k: v.to(getattr(torch, dtype)) for k, v in hf.state_dict().items()}
    executor = TorchExecutor(model_config_from_hf(hf.config.to_dict()), weights, dtype=dtype)
    loader = {w.untyped_storage().data_ptr() for w in weights.values()}
    model = executor.model
    kept = [model.embed, model.norm, model.lm_head, *(
        t for layer in model.layers for t in (layer.input_norm, layer.qkv, layer.o,
                                              layer.post_norm, layer.gate_up, layer.down))]
    tensors = [u for t in kept for u in (
        [t.data, t.dense] if isinstance(t, PackedWeight) else [t]) if u is not None]
    assert all(t.is_mkldnn or t.untyped_storage().data_ptr() not in loader for t in tensors)
