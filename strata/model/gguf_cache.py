"""The safetensors cache of dequantized GGUF models, and `load_gguf`.

A GGUF file is dequantized once into one safetensors file under `cache_dir/gguf/`, keyed by the
file's size, mtime and first bytes and by the dtype; its metadata holds the config and the
tokenizer, so a later load reads nothing else. The cache is written tensor by tensor (the header
first, from the GGUF's tensor list, then each tensor as it is dequantized), so converting never
holds the model in float32: a tensor-parallel rank then reads only its slices of the cache file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from strata.model.config import ModelConfig
from strata.model.gguf_loader import GGUFHeader, GGUFModel, gguf_tensors, open_gguf
from strata.model.tokenizer import Tokenizer

CACHE_FORMAT = "strata-gguf-2"  # 2: the config holds rope_freq_factors
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def load_gguf(path: Path, *, dtype: torch.dtype, cache_dir: Path | None) -> GGUFModel:
    """Load `path`, from the dequantized cache in `cache_dir` when it is there (and then write
    it there). The weights of a first load are the ones just dequantized, not a map of the
    cache file."""
    cache_file = cache_file_of(path, dtype, cache_dir) if cache_dir is not None else None
    if cache_file is not None and cache_file.exists():
        cached = read_cache(cache_file, path)
        if cached is not None:
            return cached
    header = open_gguf(path)
    weights = dict(gguf_tensors(header, dtype))
    if cache_file is not None:
        shapes = {name: tuple(t.shape) for name, t in weights.items()}
        _write_cache(cache_file, header, shapes, iter(weights.items()), dtype)
    return GGUFModel(header.config, weights, header.tokenizer, header.name, path)


def convert_gguf(path: Path, *, dtype: torch.dtype, cache_dir: Path) -> Path:
    """The cache file of `path` in `dtype`, written now (tensor by tensor, straight from the
    GGUF file) unless a readable one exists."""
    cache_file = cache_file_of(path, dtype, cache_dir)
    if cache_file.exists() and cached_header(cache_file, path) is not None:
        return cache_file
    header = open_gguf(path)
    _write_cache(cache_file, header, header.tensor_shapes(), gguf_tensors(header, dtype), dtype)
    return cache_file


def cache_file_of(path: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    st = path.stat()
    digest = hashlib.sha256(f"{CACHE_FORMAT}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 16))
    return cache_dir / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}.safetensors"


def _write_cache(cache_file: Path, header: GGUFHeader, shapes: dict[str, tuple[int, ...]],
                 tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    meta = {
        "format": CACHE_FORMAT,
        "name": header.name,
        "config": {f.name: getattr(header.config, f.name)
                   for f in dataclasses.fields(header.config)},
        "tokenizer": header.tokenizer.to_json(),
        "chat_template": header.tokenizer.chat_template,
        "bos_token": header.tokenizer.bos_token,
        "eos_token": header.tokenizer.eos_token,
        "eos_token_ids": list(header.tokenizer.eos_token_ids),
    }
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".tmp")
    os.close(fd)
    try:
        write_safetensors(Path(tmp), shapes, dtype, tensors,
                          {"strata": json.dumps(meta)})
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
        os.replace(tmp, cache_file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_safetensors(file: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                      tensors: Iterator[tuple[str, torch.Tensor]],
                      metadata: dict[str, str]) -> None:
    """A safetensors file whose header is planned from `shapes` and whose tensors are written
    as `tensors` yields them (same names, order and shapes), one in memory at a time."""
    item = torch.empty((), dtype=dtype).element_size()
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * item
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    expected = iter(shapes.items())
    with file.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, tensor in tensors:
            want = next(expected, None)
            if want != (name, tuple(tensor.shape)):
                raise RuntimeError(f"invariant planned_tensor_order: got {name} "
                                   f"{list(tensor.shape)}, planned {want}")
            f.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy().data)
    if next(expected, None) is not None:
        raise RuntimeError("invariant planned_tensor_order: fewer tensors than planned")


def cached_header(cache_file: Path, source: Path) -> tuple[ModelConfig, Tokenizer, str] | None:
    """(config, tokenizer, name) from a cache file's metadata; None when unreadable."""
    try:
        with safe_open(str(cache_file), "pt") as f:
            meta = json.loads(f.metadata()["strata"])
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError):
        return None
    if meta.get("format") != CACHE_FORMAT:
        return None
    cfg = dict(meta["config"], eos_token_ids=tuple(meta["config"]["eos_token_ids"]))
    if cfg.get("rope_freq_factors") is not None:
        cfg["rope_freq_factors"] = tuple(cfg["rope_freq_factors"])
    tokenizer = Tokenizer(
        HFTokenizer.from_str(meta["tokenizer"]),
        chat_template=meta["chat_template"],
        bos_token=meta["bos_token"],
        eos_token=meta["eos_token"],
        eos_token_ids=meta["eos_token_ids"],
        source=str(source),
    )
    return ModelConfig(**cfg), tokenizer, meta["name"]


def read_cache(cache_file: Path, source: Path) -> GGUFModel | None:
    """The cached model, or None when the cache file is unreadable (it is then rewritten)."""
    header = cached_header(cache_file, source)
    if header is None:
        return None
    try:
        weights = load_file(str(cache_file))
    except (SafetensorError, OSError):
        return None
    config, tokenizer, name = header
    return GGUFModel(config, weights, tokenizer, name, source)
