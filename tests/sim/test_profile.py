"""The latency model: step times, JSON round trip, and the least-squares fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.errors import ConfigError
from strata.sim.profile import LatencyProfile, ProfilePoint, fit_error, fit_profile

TRUE = LatencyProfile(model="m", source="synthetic", prefill_ms_base=4.0,
                      prefill_ms_per_token=0.25, decode_ms_base=6.0, decode_ms_per_seq=0.5,
                      decode_ms_per_context_token=0.001)


def _point(p: int, d: int, c: int) -> ProfilePoint:
    return ProfilePoint(p, d, c, TRUE.step_ms(p, d, c))


def test_step_time_of_prefill_decode_mixed_and_empty_steps() -> None:
    assert TRUE.step_ms(100, 0, 0) == 4.0 + 25.0
    assert TRUE.step_ms(0, 8, 1000) == 6.0 + 4.0 + 1.0
    assert TRUE.step_ms(100, 8, 1000) == 4.0 + 25.0 + 4.0 + 1.0  # one forward pass, one base
    assert TRUE.step_ms(0, 0, 0) == 0.0
    assert TRUE.step_time_s(100, 0, 0) == 0.029


def test_fit_recovers_known_coefficients() -> None:
    points = [_point(n, 0, 0) for n in (16, 64, 256, 512)]
    points += [_point(0, b, b * ctx) for b in (1, 4, 16, 32) for ctx in (64, 512)]
    fitted = fit_profile(points, model="m", source="synthetic")
    assert fitted.prefill_ms_base == pytest.approx(4.0, abs=1e-9)
    assert fitted.prefill_ms_per_token == pytest.approx(0.25, abs=1e-12)
    assert fitted.decode_ms_base == pytest.approx(6.0, abs=1e-9)
    assert fitted.decode_ms_per_seq == pytest.approx(0.5, abs=1e-9)
    assert fitted.decode_ms_per_context_token == pytest.approx(0.001, abs=1e-12)
    assert fitted.points == tuple(points)
    assert fit_error(fitted, points) == pytest.approx(0.0, abs=1e-9)


def test_context_coefficient_is_zero_when_context_follows_batch_size() -> None:
    # every sequence has 100 tokens of context: the batch term absorbs the context cost
    points = [_point(n, 0, 0) for n in (16, 512)] + [_point(0, b, 100 * b) for b in (1, 8, 32)]
    fitted = fit_profile(points)
    assert fitted.decode_ms_per_context_token == 0.0
    assert fitted.decode_ms_per_seq == pytest.approx(0.5 + 100 * 0.001, abs=1e-9)
    assert fit_error(fitted, points) == pytest.approx(0.0, abs=1e-9)


def test_fit_refuses_too_few_distinct_points() -> None:
    with pytest.raises(ConfigError, match="at least two different prefill lengths"):
        fit_profile([_point(64, 0, 0), _point(64, 0, 0), _point(0, 1, 10), _point(0, 2, 20)])
    with pytest.raises(ConfigError, match="at least two different decode batch sizes"):
        fit_profile([_point(16, 0, 0), _point(64, 0, 0), _point(0, 4, 40)])


def test_json_round_trip_keeps_coefficients_and_points(tmp_path: Path) -> None:
    profile = fit_profile([_point(16, 0, 0), _point(64, 0, 0), _point(0, 1, 9), _point(0, 2, 18)],
                          model="tiny", source="fitted from tiny on 2026-01-01",
                          kv_bytes_per_token=23040)
    profile.save(tmp_path / "p.json")
    loaded = LatencyProfile.load(tmp_path / "p.json")
    assert loaded == profile
    assert loaded.points == profile.points
    assert loaded.kv_bytes_per_token == 23040


def test_invalid_profiles_say_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"format": 1, "model": "m"}')
    with pytest.raises(ConfigError, match=r"bad.json: not a valid latency profile"):
        LatencyProfile.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match=r"decode_ms_per_seq must be >= 0, got -1"):
        LatencyProfile("m", "synthetic", 1.0, 1.0, 1.0, -1.0)
    with pytest.raises(ConfigError, match=r"cannot read the latency profile"):
        LatencyProfile.load(tmp_path / "missing.json")


def test_load_profile_by_path_or_bundled_name(tmp_path: Path) -> None:
    from strata.sim.profile import bundled_profiles, load_profile

    TRUE.save(tmp_path / "mine.json")
    assert load_profile(str(tmp_path / "mine.json")) == TRUE
    assert "smollm2-cpu" in bundled_profiles()
    shipped = load_profile("smollm2-cpu")
    assert shipped.model == "SmolLM2-135M-Instruct"
    assert shipped.source.startswith("fitted from SmolLM2-135M-Instruct on ")
    assert shipped.kv_bytes_per_token == 23040  # bfloat16: 30 layers x K,V x 3 heads x 64 x 2
    with pytest.raises(ConfigError, match=r"nope: no such profile file, and not a bundled "
                                          r"profile \(bundled: .*smollm2-cpu"):
        load_profile("nope")
