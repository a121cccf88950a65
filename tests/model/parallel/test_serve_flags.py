"""The serve flags of tensor and pipeline parallel: defaults, per-rank threads, refusals."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from model.parallel.parallel_helpers import make_nine_head_model

from strata.cli import build_parser, main
from strata.commands.serve_parallel import load_for_serving, parallel_layout, rank_threads
from strata.errors import ConfigError


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_one_process_by_default() -> None:
    args = serve_args()
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)
    assert args.distributed_executor == "mp" and parallel_layout(args) is None
    assert rank_threads(args) is None  # torch's own default, as before


def test_layout_and_threads_per_rank() -> None:
    layout = parallel_layout(serve_args("-tp", "2", "-pp", "2", "--pipeline-layers", "10,20"))
    assert layout is not None and layout.name == "tp2xpp2"
    assert layout.pipeline_layers == (10, 20)
    assert rank_threads(serve_args("-tp", "2")) == max(1, (os.cpu_count() or 1) // 2)
    assert rank_threads(serve_args("-tp", "2", "--threads", "3")) == 3


@pytest.mark.parametrize(("flags", "message"), [
    (["-tp", "2", "--ray-placement-group", "ab12"], "need --distributed-executor ray"),
    (["-tp", "2", "--simulate", "smollm2-cpu"], "--simulate has no ranks"),
    (["-pp", "2", "--pipeline-layers", "15,x"], "layer counts separated by commas"),
    (["-pp", "2", "--pipeline-layers", "30"], "one number per stage"),
])
def test_flags_that_cannot_work_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parallel_layout(serve_args(*flags))


def test_a_size_the_model_cannot_split_is_refused_before_any_rank_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_nine_head_model(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"cannot split the model's 9 attention heads .*"
                                          r"valid sizes: 1 \.\. 9"):
        load_for_serving(serve_args(str(model), "-tp", "10"), model, tmp_path / "cache")
    assert main(["serve", str(model), "-tp", "10", "--port", "0"]) != 0
    assert "valid sizes" in capsys.readouterr().err
