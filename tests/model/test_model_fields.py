"""Model fields that change the maths are computed or refused by name, never ignored.

Story: a tiny Llama-3-style model (rope scaling `llama3`) converted to GGUF the way llama.cpp's
converter does carries its scaling as the `rope_freqs` tensor; loaded from the GGUF, its rotary
frequencies are HF's and its greedy tokens are HF's. Then every field Strata does not compute,
in config.json or in GGUF metadata, is refused with its name and value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from model.test_llama_parity import hf_greedy, prompts, run_greedy
from tiny_models import make_tiny_model_dir, tiny_hf_config, write_tiny_gguf
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from strata.errors import ModelLoadError
from strata.model.executor import TorchExecutor
from strata.model.hf_config import model_config_from_hf
from strata.model.llama import rope_inv_freq
from strata.model.loader import load_model

# head_dim 16: 8 frequencies with wavelengths 6.3 .. 19869; against an original context of 64
# (high-frequency bound 8, low-frequency bound 64) one is kept, two are smoothed, five divided.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama3"
    return make_tiny_model_dir(path, rope_parameters=LLAMA3_ROPE, initializer_range=0.2)


@pytest.fixture(scope="module")
def llama3_gguf(llama3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(llama3_dir, tmp_path_factory.mktemp("gguf") / "llama3.gguf")


def test_gguf_rope_freqs_give_hf_llama3_frequencies(llama3_dir: Path, llama3_gguf: Path) -> None:
    gguf_config = load_model(llama3_gguf, dtype="float32").config
    factors = gguf_config.rope_freq_factors
    assert factors is not None and len(factors) == 8
    assert (factors[0], factors[3:]) == (1.0, (4.0,) * 5)  # kept, then divided by the factor
    assert all(1.0 < f < 4.0 for f in factors[1:3])  # smoothed
    hf = AutoModelForCausalLM.from_pretrained(llama3_dir)
    expected = LlamaRotaryEmbedding(hf.config).inv_freq
    torch.testing.assert_close(rope_inv_freq(gguf_config), expected, rtol=1e-6, atol=0.0)
    hf_dir_config = load_model(llama3_dir, dtype="float32").config
    torch.testing.assert_close(rope_inv_freq(hf_dir_config), expected, rtol=1e-6, atol=0.0)
    # The frequencies of the file ignoring rope_freqs (as the loader once did) are not HF's.
    unscaled = rope_inv_freq(dataclasses.replace(gguf_config, rope_freq_factors=None))
    assert not torch.allclose(unscaled, expected, rtol=1e-3)


def test_gguf_llama3_greedy_tokens_match_hf(llama3_dir: Path, llama3_gguf: Path) -> None:
    model = load_model(llama3_gguf, dtype="float32")
    executor = TorchExecutor(model.config, model.weights, dtype="float32")
    executor.allocate_kv_cache(64, 4)
    hf = AutoModelForCausalLM.from_pretrained(llama3_dir).eval()
    token_lists = prompts()  # up to 40 + 32 positions: past the original context of 64
    assert run_greedy(executor, token_lists) == [hf_greedy(hf, p) for p in token_lists]


def test_rope_freqs_survive_the_safetensors_cache(llama3_gguf: Path, tmp_path: Path) -> None:
    first = load_model(llama3_gguf, dtype="float32", cache_dir=tmp_path)
    second = load_model(llama3_gguf, dtype="float32", cache_dir=tmp_path)
    assert second.config == first.config and second.config.rope_freq_factors is not None


def test_rope_freqs_of_the_wrong_length_are_refused(llama3_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(llama3_dir, tmp_path / "short.gguf", omit_tensors=["rope_freqs.weight"],
                           extra_tensors={"rope_freqs.weight": np.ones(5, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match=r"'rope_freqs.weight' must hold head_dim / 2 = 8 "
                                             r"positive factors, got shape \[5\]"):
        load_model(path)


HF_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("llama", {"hidden_act": "gelu"}, "field 'hidden_act' = 'gelu'"),
    ("llama", {"mlp_bias": True}, "field 'mlp_bias' = True"),
    ("llama", {"attention_bias": True}, "field 'attention_bias' = True"),
    ("mistral", {"sliding_window": 128}, "field 'sliding_window' = 128"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 0},
     "field 'sliding_window' = 128"),
    ("llama", {"attn_logit_softcapping": 50.0}, "field 'attn_logit_softcapping' = 50.0"),
    ("llama", {"final_logit_softcapping": 30.0}, "field 'final_logit_softcapping' = 30.0"),
    ("llama", {"query_pre_attn_scalar": 256}, "field 'query_pre_attn_scalar' = 256"),
    ("llama", {"partial_rotary_factor": 0.5}, "field 'partial_rotary_factor' = 0.5"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5}},
     "field 'rope_parameters.partial_rotary_factor' = 0.5"),
    ("llama", {"quantization_config": {"quant_method": "fp8"}},
     "field 'quantization_config' = {'quant_method': 'fp8'}"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]},
     "field 'layer_types' = ['full_attention', 'sliding_attention']"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "field 'rope_scaling.rope_type' = 'yarn' is not supported"),
]


@pytest.mark.parametrize(("arch", "fields", "message"), HF_REFUSED,
                         ids=[next(iter(f)) for _, f, _ in HF_REFUSED])
def test_hf_field_strata_does_not_compute_is_refused_by_name(
    arch: str, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError) as info:
        model_config_from_hf(tiny_hf_config(arch, **fields), source="m/config.json")
    assert str(info.value).startswith(f"m/config.json: {message} ")


@pytest.mark.parametrize(("arch", "fields"), [
    ("mistral", {"sliding_window": 256}),  # as long as the context: full attention
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 128}),  # off
    ("qwen2", {"layer_types": ["full_attention", "full_attention"]}),
    ("llama", {"partial_rotary_factor": 1.0, "attention_bias": False, "mlp_bias": False}),
    ("llama", {"head_dim": 32, "tie_word_embeddings": True}),  # implemented
])
def test_hf_fields_strata_computes_are_accepted(arch: str, fields: dict[str, Any]) -> None:
    config = model_config_from_hf(tiny_hf_config(arch, **fields))
    assert config.architecture == arch


GGUF_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
     "'llama.rope.scaling.type' = 'linear' is not implemented by Strata (it computes no rope "
     "scaling other than the rope_freqs tensor)"),
    ({"llama.rope.scaling.factor": 2.0},  # llama.cpp reads it as linear scaling
     "'llama.rope.scaling.factor' = 2.0 is not implemented by Strata (it computes no linear or "
     "YaRN rope scaling)"),
    ({"llama.rope.dimension_count": 8},
     "'llama.rope.dimension_count' = 8 is not implemented by Strata (it computes rotary over "
     "the whole head (head_dim))"),
    ({"llama.attention.value_length": 8}, "'llama.attention.value_length' = 8"),
    ({"llama.attention.sliding_window": 64}, "'llama.attention.sliding_window' = 64"),
    ({"llama.expert_count": 8}, "'llama.expert_count' = 8"),
    ({"llama.attn_logit_softcapping": 50.0},
     "'llama.attn_logit_softcapping' = 50.0 is not implemented by Strata (an unknown "
     "hyperparameter)"),
]


@pytest.mark.parametrize(("keys", "message"), GGUF_REFUSED, ids=[k for k, _ in GGUF_REFUSED
                                                                  for k in [next(iter(k))]])
def test_gguf_field_strata_does_not_compute_is_refused_by_name(
    llama3_dir: Path, tmp_path: Path, keys: dict[str, Any], message: str
) -> None:
    path = write_tiny_gguf(llama3_dir, tmp_path / "odd.gguf", extra_keys=keys)
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    assert str(info.value).startswith(f"{path}: GGUF metadata field {message}")


def test_gguf_fields_strata_computes_are_accepted(llama3_dir: Path, tmp_path: Path) -> None:
    keys = {"llama.rope.dimension_count": 16, "llama.attention.value_length": 16,
            "llama.rope.scaling.type": "none", "llama.attention.sliding_window": 256,
            "llama.expert_count": 0}
    path = write_tiny_gguf(llama3_dir, tmp_path / "ok.gguf", extra_keys=keys)
    assert load_model(path).config.head_dim == 16


def test_gguf_bias_strata_does_not_have_is_refused(llama3_dir: Path, tmp_path: Path) -> None:
    bias = {"blk.0.attn_q.bias": np.zeros(64, dtype=np.float32)}
    path = write_tiny_gguf(llama3_dir, tmp_path / "bias.gguf", extra_tensors=bias)
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    assert str(info.value) == (f"{path}: tensor 'blk.0.attn_q.bias' is not implemented by "
                               "Strata (llama layers have no biases)")
