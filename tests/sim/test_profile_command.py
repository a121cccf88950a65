"""`strata profile` on a tiny real model: every configuration measured, a loadable profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiny_models import make_tiny_model_dir

from strata.commands import profile as profile_command
from strata.commands.env import CliEnv
from strata.sim.profile import LatencyProfile


def test_profile_measures_prefill_and_decode_and_writes_a_fit(
        tmp_path: Path, capsys: object) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny", max_position_embeddings=1024)
    parser = argparse.ArgumentParser()
    profile_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", str(model), "--out", str(tmp_path / "p.json"),
                              "--dtype", "float32", "--max-batch", "4", "--repeats", "2",
                              "--device", "cpu"])
    env = CliEnv(cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")
    assert profile_command.run(args, env) == 0
    profile = LatencyProfile.load(tmp_path / "p.json")
    assert profile.model == "tiny"
    assert profile.source.startswith("fitted from tiny on ")
    assert profile.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4  # K+V, 2 kv heads, dim 16, 2 layers
    prefill = sorted(p.num_prefill_tokens for p in profile.points if p.num_decode_seqs == 0)
    single = [16, 64, 128, 256, 512]  # one prompt each
    # the decode batches' own prefill-only steps; 4 x 256 tokens exceed the 512-token budget:
    # its first chunk is prefill-only, the rest mixes with decodes and is left out of the fit
    batched = [1 * 32, 1 * 256, 2 * 32, 2 * 256, 4 * 32, 512]
    assert prefill == sorted((single + batched) * 2)  # 2 repeats (after an unrecorded run)
    batches = [p.num_decode_seqs for p in profile.points if p.num_prefill_tokens == 0]
    # batch sizes 1, 2, 4; contexts 32 and 256; 6 decode steps each
    assert sorted(set(batches)) == [1, 2, 4] and len(batches) == 3 * 2 * 6 * 2
    assert min(p.step_ms for p in profile.points) > 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "fit error (RMS relative)" in out and f"wrote {tmp_path / 'p.json'}" in out


def test_median_points_take_one_point_per_step_shape() -> None:
    from strata.sim.profile import ProfilePoint

    raw = [ProfilePoint(16, 0, 0, 900.0), ProfilePoint(16, 0, 0, 10.0),
           ProfilePoint(16, 0, 0, 12.0), ProfilePoint(0, 2, 40, 5.0), ProfilePoint(0, 2, 40, 7.0)]
    assert profile_command.median_points(raw) == [ProfilePoint(0, 2, 40, 6.0),
                                                   ProfilePoint(16, 0, 0, 12.0)]
