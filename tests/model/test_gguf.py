"""GGUF files written like llama.cpp's converter load back to HF weights, config and tokenizer."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import MERGES, make_tiny_model_dir, write_tiny_gguf
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import ModelLoadError
from strata.model.gguf_loader import unpermute
from strata.model.loader import LoadedModel, load_model

Q = gguf.GGMLQuantizationType
TEXTS = ["the hello world", "<|im_start|>user\nhéllo 世界 🙂<|im_end|>\n", "  a\n\nb 12 ok"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir, dtype="float32")


def _gguf(tiny_dir: Path, tmp_path: Path, qtype: Q = Q.F32, **omit: list[str]) -> Path:
    return write_tiny_gguf(tiny_dir, tmp_path / f"tiny-{qtype.name}.gguf", qtype, **omit)


@pytest.mark.parametrize(("qtype", "atol"), [(Q.F32, 0.0), (Q.F16, 1e-4), (Q.Q8_0, 2e-3)])
def test_weights_come_back_in_hf_layout(
    tiny_dir: Path, hf_model: LoadedModel, tmp_path: Path, qtype: Q, atol: float
) -> None:
    model = load_model(_gguf(tiny_dir, tmp_path, qtype), dtype="float32")
    assert sorted(model.weights) == sorted(hf_model.weights)
    for name, expected in hf_model.weights.items():
        got = model.weights[name]
        assert got.shape == expected.shape, name
        assert torch.allclose(got, expected, rtol=0.0, atol=atol), name
    if qtype != Q.F32:  # quantization did change something
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(model.weights[q], hf_model.weights[q])


def test_q_and_k_are_permuted_in_the_file_and_unpermuted_on_load(
    tiny_dir: Path, hf_model: LoadedModel, tmp_path: Path
) -> None:
    reader = gguf.GGUFReader(_gguf(tiny_dir, tmp_path))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    hf_k = hf_model.weights["model.layers.1.self_attn.k_proj.weight"].numpy()
    assert not np.array_equal(stored["blk.1.attn_k.weight"], hf_k)
    assert np.array_equal(unpermute(stored["blk.1.attn_k.weight"], 2), hf_k)
    hf_v = hf_model.weights["model.layers.1.self_attn.v_proj.weight"].numpy()
    assert np.array_equal(stored["blk.1.attn_v.weight"], hf_v)


def test_config_from_metadata(tiny_dir: Path, hf_model: LoadedModel, tmp_path: Path) -> None:
    model = load_model(_gguf(tiny_dir, tmp_path))
    # GGUF stores one eos id (generation_config's <|im_end|>), HF unions it with config.json's
    im_end = hf_model.tokenizer.token_to_id("<|im_end|>")
    assert model.config == dataclasses.replace(hf_model.config, eos_token_ids=(im_end,))
    assert model.name == "tiny"


def test_tokenizer_and_chat_template_from_metadata(
    tiny_dir: Path, hf_model: LoadedModel, tmp_path: Path
) -> None:
    tok = load_model(_gguf(tiny_dir, tmp_path)).tokenizer
    original = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == original.encode(text).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.vocab_size == 300  # padded with [PAD] tokens to the config's vocab size
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == hf_model.tokenizer.apply_chat_template(messages)


def test_add_bos_token_flag_prepends_bos_with_special_tokens(
    tiny_dir: Path, tmp_path: Path
) -> None:
    plain = load_model(_gguf(tiny_dir, tmp_path)).tokenizer
    assert plain.encode("hi", add_special_tokens=True) == plain.encode("hi")
    path = write_tiny_gguf(tiny_dir, tmp_path / "bos.gguf", add_bos_token=True)
    tok = load_model(path).tokenizer
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("hi")]
    assert tok.bos_token_id == plain.bos_token_id == 257 + len(MERGES)  # <|im_start|>


def test_tied_embeddings_when_there_is_no_output_tensor(tmp_path: Path) -> None:
    tied_dir = make_tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(write_tiny_gguf(tied_dir, tmp_path / "tied.gguf"))
    assert model.config.tie_word_embeddings is True
    assert "lm_head.weight" not in model.weights


def test_second_load_reads_the_safetensors_cache(tiny_dir: Path, tmp_path: Path) -> None:
    path, cache = _gguf(tiny_dir, tmp_path), tmp_path / "cache"
    first = load_model(path, dtype="float32", cache_dir=cache)
    cached = list((cache / "gguf").iterdir())
    assert [p.suffix for p in cached] == [".safetensors"]
    # Overwrite the last tensor's data in place, keeping size and mtime: only a cache hit
    # can still return the original weights.
    stat = path.stat()
    with path.open("r+b") as f:
        f.seek(-1024, os.SEEK_END)
        f.write(b"\xff" * 1024)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = load_model(path, dtype="float32", cache_dir=cache)
    assert all(torch.equal(second.weights[n], t) for n, t in first.weights.items())
    assert second.config == first.config and second.name == first.name
    assert second.tokenizer.encode(TEXTS[1]) == first.tokenizer.encode(TEXTS[1])
    assert second.tokenizer.apply_chat_template([]) == first.tokenizer.apply_chat_template([])
    uncached = load_model(path, dtype="float32")
    assert not all(torch.equal(uncached.weights[n], t) for n, t in first.weights.items())


def test_changed_file_or_dtype_misses_the_cache(tiny_dir: Path, tmp_path: Path) -> None:
    path, cache = _gguf(tiny_dir, tmp_path), tmp_path / "cache"
    load_model(path, dtype="float32", cache_dir=cache)
    load_model(path, dtype="bfloat16", cache_dir=cache)
    assert len(list((cache / "gguf").iterdir())) == 2
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    load_model(path, dtype="float32", cache_dir=cache)
    assert len(list((cache / "gguf").iterdir())) == 3


def test_corrupt_cache_file_is_rebuilt(tiny_dir: Path, tmp_path: Path) -> None:
    path, cache = _gguf(tiny_dir, tmp_path), tmp_path / "cache"
    first = load_model(path, dtype="float32", cache_dir=cache)
    (cache_file,) = (cache / "gguf").iterdir()
    cache_file.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    again = load_model(path, dtype="float32", cache_dir=cache)
    assert all(torch.equal(again.weights[n], t) for n, t in first.weights.items())
    assert cache_file.stat().st_size > 100_000


def test_truncated_file_names_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    path = _gguf(tiny_dir, tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=rf"^{path}: not a readable GGUF file"):
        load_model(path)


def test_garbage_file_is_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely not gguf" * 10)
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a readable GGUF file.*magic"):
        load_model(path)


def test_missing_metadata_field_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    path = _gguf(tiny_dir, tmp_path, omit_keys=["llama.block_count"])
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    assert str(info.value) == f"{path}: GGUF metadata field 'llama.block_count' is missing"


def test_missing_tokenizer_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    path = _gguf(tiny_dir, tmp_path, omit_keys=["tokenizer.ggml.model"])
    with pytest.raises(ModelLoadError, match="field 'tokenizer.ggml.model' is missing"):
        load_model(path)


def test_missing_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    path = _gguf(tiny_dir, tmp_path, omit_tensors=["blk.1.ffn_down.weight"])
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    assert str(info.value) == f"{path}: missing tensor 'model.layers.1.mlp.down_proj.weight'"


def test_tensor_type_that_cannot_be_dequantized(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    src = gguf.GGUFReader(_gguf(tiny_dir, tmp_path))
    writer = gguf.GGUFWriter(path, "llama")
    for field in src.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    for t in src.tensors:
        data = np.array(t.data)
        if t.name == "output_norm.weight":
            data = data.astype(np.int32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'output_norm.weight' has type I32, which cannot"):
        load_model(path)
