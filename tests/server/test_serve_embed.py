"""`strata serve --task embed` as the CLI parses it: the stack it builds over an HF BERT
directory (whole inputs, no prefix cache, float32, the encoder's positions), and the flags and
models each task refuses."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tiny_bert import HIDDEN, MAX_POSITIONS, make_tiny_bert_dir

from strata.commands import serve
from strata.commands.env import CliEnv
from strata.commands.serve_embed import build_embed_engine
from strata.commands.serve_stack import build_engine
from strata.errors import ConfigError
from strata.model.bert import EncoderExecutor


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert_dir(tmp_path_factory.mktemp("serve-embed") / "tiny-bert")


def test_task_embed_builds_an_encoder_engine(bert_dir: Path, tmp_path: Path) -> None:
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path)
    built = build_embed_engine(serve_args(str(bert_dir), "--task", "embed", "--device", "cpu"),
                               env)
    engine = built.async_engine.engine
    assert built.name == "tiny-bert" and built.embed is not None
    assert built.embed.num_dimensions == HIDDEN and not built.embed.is_matryoshka
    assert isinstance(engine.executor, EncoderExecutor)  # type: ignore[attr-defined]
    assert built.async_engine.max_model_len == MAX_POSITIONS
    assert not engine.cache_config.enable_prefix_caching  # type: ignore[attr-defined]
    assert not engine.scheduler_config.enable_chunked_prefill  # type: ignore[attr-defined]


def test_each_task_refuses_the_others_model_and_flags(bert_dir: Path, tmp_path: Path) -> None:
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path)
    with pytest.raises(ConfigError, match="is a sentence encoder .* --task embed"):
        build_engine(serve_args(str(bert_dir)), env)
    with pytest.raises(ConfigError, match="drop --simulate"):
        build_embed_engine(serve_args("--task", "embed", "--simulate", "smollm2-cpu"), env)
