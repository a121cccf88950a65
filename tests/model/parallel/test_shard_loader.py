"""Each rank reads only its slices, from an HF directory (one file or an index of several) and
from a GGUF file converted tensor by tensor into the safetensors cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model.parallel.parallel_helpers import make_nine_head_model
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny_gguf

from strata.errors import ModelLoadError
from strata.model.gguf_cache import cache_file_of, write_safetensors
from strata.model.loader import load_model
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import load_shard, prepare_model, shard_slices

LAYOUT = ParallelLayout(tensor_size=2, pipeline_size=2)


def check_every_rank(source: Path, cache_dir: Path | None) -> None:
    """Every rank's tensors are exactly its slices of the whole model's, and it holds no
    tensor whole that the layout splits."""
    whole = load_model(source, dtype="float32", cache_dir=cache_dir).weights
    prepared = prepare_model(source, dtype="float32", cache_dir=cache_dir)
    total = sum(t.numel() for t in whole.values())
    held = 0
    for rank in range(LAYOUT.world_size):
        shard = LAYOUT.shard(rank, prepared.config)
        slices = shard_slices(prepared.config, shard)
        got = load_shard(prepared.weights, prepared.config, shard, "float32")
        assert set(got) == set(slices)
        for name, tensor in got.items():
            rows, cols = slices[name]
            want = whole[name][rows] if tensor.dim() == 1 else whole[name][rows, cols]
            assert torch.equal(tensor, want), name
        held_here = sum(t.numel() for t in got.values())
        assert held_here < 0.5 * total  # a quarter of the layers, half the vocabulary rows
        held += held_here
    assert held > total  # the shared KV head and the norms are held twice, nothing is missing


def test_hf_single_file(model_dir: Path) -> None:
    check_every_rank(model_dir, None)


def test_tied_embeddings_give_the_last_stage_its_vocab_rows(tmp_path: Path) -> None:
    tied = make_nine_head_model(tmp_path / "tied", tie_word_embeddings=True)
    check_every_rank(tied, None)
    config = prepare_model(tied, dtype="float32", cache_dir=None).config
    last = shard_slices(config, LAYOUT.shard(3, config))
    assert "model.embed_tokens.weight" in last and "lm_head.weight" not in last


def test_hf_index_of_several_files(model_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (sharded / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for part, chunk in enumerate((names[::2], names[1::2])):
        file = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(sharded / file))
        weight_map |= dict.fromkeys(chunk, file)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_every_rank(sharded, None)


def test_gguf_through_the_streamed_cache(model_dir: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(model_dir, tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    prepared = prepare_model(gguf, dtype="float32", cache_dir=cache)
    assert prepared.weights.files == {"*": str(cache_file_of(gguf, torch.float32, cache))}
    in_memory = load_model(gguf, dtype="float32").weights  # no cache: dequantized in memory
    streamed = load_file(prepared.weights.files["*"])
    assert set(streamed) == set(in_memory)
    assert all(torch.equal(streamed[n], t) for n, t in in_memory.items())
    check_every_rank(gguf, cache)  # the whole-model loader reads the same cache file


def test_the_streamed_writer_keeps_to_its_plan(tmp_path: Path) -> None:
    shapes = {"a": (2, 3), "b": (4,)}
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    write_safetensors(tmp_path / "ok.safetensors", shapes, torch.bfloat16, iter(tensors.items()),
                      {"k": "v"})
    back = load_file(str(tmp_path / "ok.safetensors"))
    assert all(torch.equal(back[n], t.bfloat16()) for n, t in tensors.items())
    with pytest.raises(RuntimeError, match="planned_tensor_order"):
        write_safetensors(tmp_path / "bad.safetensors", shapes, torch.float32,
                          iter([("b", tensors["b"])]), {})


def test_a_missing_or_misshapen_tensor_is_named(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.down_proj"):
        prepare_model(broken, dtype="float32", cache_dir=None)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.down_proj.weight' has shape "
                                             r"\[3, 3\], expected \[144, 128\]"):
        prepare_model(broken, dtype="float32", cache_dir=None)
