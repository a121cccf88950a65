"""The model's sampling defaults: read from generation_config.json and from GGUF metadata,
carried by `load_model`; wrong types are ignored, never a failed load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_models import make_tiny_model_dir, write_tiny_gguf

from strata.model.generation_defaults import GenerationDefaults, read_generation_defaults
from strata.model.loader import load_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("gd") / "tiny")


def with_generation_config(tiny_dir: Path, tmp_path: Path, extra: dict[str, object]) -> Path:
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "m"))
    file = copy / "generation_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | extra))
    return copy


def test_none_set_is_empty(tiny_dir: Path) -> None:
    assert read_generation_defaults(tiny_dir) == GenerationDefaults()
    assert GenerationDefaults().as_dict() == {}


def test_hf_fields_reach_the_loaded_model(tiny_dir: Path, tmp_path: Path) -> None:
    path = with_generation_config(tiny_dir, tmp_path, {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
        "max_new_tokens": 64, "do_sample": True, "min_p": "x"})
    expected = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20,
                                  repetition_penalty=1.1, max_tokens=64)
    assert load_model(path, dtype="float32").generation_defaults == expected
    assert expected.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                  "repetition_penalty": 1.1, "max_tokens": 64}


def test_wrong_types_are_dropped(tiny_dir: Path, tmp_path: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    path = with_generation_config(tiny_dir, tmp_path, {"temperature": "hot", "top_k": 2.5,
                                                       "top_p": True, "max_new_tokens": 8.0})
    assert read_generation_defaults(path) == GenerationDefaults(max_tokens=8)
    assert "temperature = 'hot'" in caplog.text


def test_gguf_sampling_metadata(tiny_dir: Path, tmp_path: Path) -> None:
    gguf_file = write_tiny_gguf(tiny_dir, tmp_path / "m.gguf",
                                sampling={"temp": 0.25, "top_p": 0.5, "penalty_repeat": 1.25})
    assert load_model(gguf_file, dtype="float32").generation_defaults == GenerationDefaults(
        temperature=0.25, top_p=0.5, repetition_penalty=1.25)
    plain = write_tiny_gguf(tiny_dir, tmp_path / "plain.gguf")
    assert read_generation_defaults(plain) == GenerationDefaults()
