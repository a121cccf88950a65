"""Qwen3 (per-head q/k RMSNorm, an explicit head_dim) and Phi-3 (fused qkv and gate/up
projections) against HF transformers on tiny random checkpoints saved to disk and loaded the way
`strata serve` loads them: greedy tokens equal HF's over a shared paged cache, mixed prefill and
decode. Variants Strata does not implement are load errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model.test_llama_parity import hf_greedy, prompts, run_greedy
from tiny_models import make_tiny_tokenizer_json
from transformers import Phi3Config, Phi3ForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from strata.errors import ModelLoadError
from strata.model.executor import TorchExecutor
from strata.model.hf_config import model_config_from_hf
from strata.model.loader import load_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_hf_model(kind: str) -> PreTrainedModel:
    """Seeded random weights; norms perturbed so that they matter."""
    torch.manual_seed(4321)
    if kind == "qwen3":  # head_dim 32: not hidden / heads (16), as in the real Qwen3 models
        model: PreTrainedModel = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32))
    else:
        model = Phi3ForCausalLM(Phi3Config(**TINY))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model.eval()


def saved(hf: PreTrainedModel, path: Path) -> Path:
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_text(make_tiny_tokenizer_json(), encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["qwen3", "phi3"])
def test_greedy_tokens_match_hf(kind: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(kind)
    loaded = load_model(saved(hf, tmp_path / kind), dtype="float32")
    assert loaded.config.architecture == kind
    executor = TorchExecutor(loaded.config, loaded.weights, dtype="float32")
    executor.allocate_kv_cache(64, 4)
    token_lists = prompts()
    assert run_greedy(executor, token_lists) == [hf_greedy(hf, p) for p in token_lists]


def test_configs_exercise_their_features() -> None:
    qwen3 = model_config_from_hf(tiny_hf_model("qwen3").config.to_dict())
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    phi3 = model_config_from_hf(tiny_hf_model("phi3").config.to_dict())
    assert phi3.architecture == "phi3" and not phi3.qk_norm


@pytest.mark.parametrize(("config", "field"), [
    (Phi3Config(**TINY, partial_rotary_factor=0.75), "partial_rotary_factor"),
    (Qwen3Config(**TINY, use_sliding_window=True, sliding_window=16), "use_sliding_window"),
])
def test_unsupported_variants_are_refused_by_name(config: object, field: str) -> None:
    with pytest.raises(ModelLoadError, match=field):
        model_config_from_hf(config.to_dict())  # type: ignore[attr-defined]
