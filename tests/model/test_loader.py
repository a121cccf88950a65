"""Loading Hugging Face model directories: weights, config, tokenizer, and precise errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import CHATML_TEMPLATE, MERGES, make_tiny_model_dir

from strata.errors import ConfigError, ModelLoadError
from strata.model.loader import load_model

ENDOFTEXT, IM_START, IM_END = 256 + len(MERGES), 257 + len(MERGES), 258 + len(MERGES)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def hf_state(tiny_dir: Path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture
def work_dir(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "tiny-llama"))


def _split_in_two_shards(model_dir: Path) -> dict[str, str]:
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(model_dir / shard))
        weight_map |= {n: shard for n in shard_names}
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_single_file_weights_equal_the_hf_state_dict(
    tiny_dir: Path, hf_state: dict[str, torch.Tensor]
) -> None:
    model = load_model(tiny_dir, dtype="float32")
    assert sorted(model.weights) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(model.weights[name], tensor), name
    assert model.name == "tiny-llama"
    assert model.source == tiny_dir


def test_config_fields_and_eos_union(tiny_dir: Path) -> None:
    cfg = load_model(tiny_dir).config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size) == ("llama", 300, 64)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.rope_theta) == (16, 128, 10000.0)
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings is False
    # config.json says <|endoftext|>, generation_config.json and tokenizer_config <|im_end|>
    assert cfg.eos_token_ids == (ENDOFTEXT, IM_END)
    assert cfg.bos_token_id == IM_START


def test_default_dtype_is_bfloat16_and_tokenizer_is_wired(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    assert {t.dtype for t in model.weights.values()} == {torch.bfloat16}
    tok = model.tokenizer
    assert tok.eos_token_ids == (ENDOFTEXT, IM_END)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_two_shards_with_index(work_dir: Path, hf_state: dict[str, torch.Tensor]) -> None:
    weight_map = _split_in_two_shards(work_dir)
    assert len(set(weight_map.values())) == 2
    model = load_model(work_dir, dtype="float32")
    assert sorted(model.weights) == sorted(hf_state)
    assert all(torch.equal(model.weights[n], t) for n, t in hf_state.items())


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(model_dir)
    assert model.config.tie_word_embeddings is True
    assert "lm_head.weight" not in model.weights
    assert "model.embed_tokens.weight" in model.weights


def test_named_template_list_and_jinja_file(work_dir: Path) -> None:
    tok_cfg_file = work_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text())
    tok_cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                                {"name": "default", "template": "DEFAULT"}]
    tok_cfg_file.write_text(json.dumps(tok_cfg))
    assert load_model(work_dir).tokenizer.apply_chat_template([]) == "DEFAULT"
    (work_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    rendered = load_model(work_dir).tokenizer.apply_chat_template([], add_generation_prompt=True)
    assert rendered == "<|im_start|>assistant\n"


def test_missing_config_field_names_file_and_field(work_dir: Path) -> None:
    cfg = json.loads((work_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (work_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: missing required field 'hidden_size'"):
        load_model(work_dir)


def test_missing_tensor_in_a_shard_names_shard_and_tensor(work_dir: Path) -> None:
    weight_map = _split_in_two_shards(work_dir)
    shard2 = work_dir / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard2))
    victim = sorted(n for n, s in weight_map.items() if s == shard2.name)[0]
    save_file({n: t for n, t in tensors.items() if n != victim}, str(shard2))
    with pytest.raises(ModelLoadError) as info:
        load_model(work_dir)
    assert str(info.value) == (
        f"{shard2}: missing tensor {victim!r} (listed in model.safetensors.index.json)"
    )


def test_missing_tensor_in_single_file(work_dir: Path) -> None:
    file = work_dir / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError) as info:
        load_model(work_dir)
    assert str(info.value) == f"{work_dir}: missing tensor 'model.layers.1.mlp.up_proj.weight'"


def test_wrong_shape_names_tensor_and_both_shapes(work_dir: Path) -> None:
    file = work_dir / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError) as info:
        load_model(work_dir)
    assert str(info.value) == (
        f"{work_dir}: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64], "
        "expected [32, 64] from the model config"
    )


def test_corrupt_safetensors_names_the_file(work_dir: Path) -> None:
    (work_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors"):
        load_model(work_dir)


def test_missing_tokenizer_and_missing_weights(work_dir: Path) -> None:
    (work_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tiny-llama: missing tokenizer\.json"):
        load_model(work_dir)
    (work_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors and no model.safetensors.index"):
        load_model(work_dir)


def test_unsupported_architecture_and_bad_path_and_dtype(work_dir: Path) -> None:
    cfg = json.loads((work_dir / "config.json").read_text())
    cfg |= {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (work_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: field 'architectures'"):
        load_model(work_dir)
    with pytest.raises(ModelLoadError, match="nowhere: no such model directory or .gguf file"):
        load_model(work_dir / "nowhere")
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load_model(work_dir, dtype="int8")
