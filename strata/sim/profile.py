"""The latency model of a simulated instance, and its least-squares fit to measurements.

One engine step costs (in ms)

    prefill_ms_base + prefill_ms_per_token * P            if the step computes prompt tokens
  + decode_ms_base                                         if it decodes only
  + decode_ms_per_seq * D + decode_ms_per_context_token * C

where P counts the prompt tokens computed this step (prefix-cache hits are not computed, so they
cost nothing), D the sequences decoding one token and C the tokens those sequences attend to.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strata.errors import ConfigError
from strata.sim.faults import SimFaults

PROFILE_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measured step."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    step_ms: float


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Step-time coefficients of one model on one machine (see the module docstring)."""

    model: str
    source: str  # "fitted from <model> on <date>" or "synthetic"
    prefill_ms_base: float
    prefill_ms_per_token: float
    decode_ms_base: float
    decode_ms_per_seq: float
    decode_ms_per_context_token: float = 0.0
    kv_bytes_per_token: int = 0  # of the real model, so --kv-cache-gb means the same
    points: tuple[ProfilePoint, ...] = field(default=(), compare=False)
    faults: SimFaults = SimFaults()  # injected faults (sim/faults.py); none unless the JSON says

    def __post_init__(self) -> None:
        for name in ("prefill_ms_base", "prefill_ms_per_token", "decode_ms_base",
                     "decode_ms_per_seq", "decode_ms_per_context_token"):
            if getattr(self, name) < 0:
                raise ConfigError(f"latency profile: {name} must be >= 0, got "
                                  f"{getattr(self, name)}")

    def step_ms(self, num_prefill_tokens: int, num_decode_seqs: int,
                num_context_tokens: int = 0) -> float:
        """Modelled duration of one step in milliseconds (0 for an empty step)."""
        if num_prefill_tokens == 0 and num_decode_seqs == 0:
            return 0.0
        if num_prefill_tokens > 0:
            base = self.prefill_ms_base + self.prefill_ms_per_token * num_prefill_tokens
        else:
            base = self.decode_ms_base
        return (base + self.decode_ms_per_seq * num_decode_seqs
                + self.decode_ms_per_context_token * num_context_tokens)

    def step_time_s(self, num_prefill_tokens: int, num_decode_seqs: int,
                    num_context_tokens: int = 0) -> float:
        return self.step_ms(num_prefill_tokens, num_decode_seqs, num_context_tokens) / 1000.0

    def to_json(self) -> str:
        data: dict[str, Any] = {"format": PROFILE_FORMAT, **asdict(self)}
        data["points"] = [asdict(p) for p in self.points]
        if self.faults.is_none:
            del data["faults"]
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "profile") -> LatencyProfile:
        try:
            data = json.loads(text)
            if data.pop("format", None) != PROFILE_FORMAT:
                raise ValueError(f"format must be {PROFILE_FORMAT}")
            data["points"] = tuple(ProfilePoint(**p) for p in data.get("points", ()))
            data["faults"] = SimFaults(**data.get("faults", {}))
            return cls(**data)
        except (ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"{source}: not a valid latency profile: {e}") from None

    def save(self, path: Path) -> None:
        path.write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> LatencyProfile:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the latency profile: {e}") from None
        return cls.from_json(text, source=str(path))


def fit_profile(points: list[ProfilePoint], *, model: str = "synthetic",
                source: str = "synthetic", kv_bytes_per_token: int = 0) -> LatencyProfile:
    """Least-squares coefficients from prefill-only and decode-only steps.

    Needs at least two prefill points of different lengths and two decode points of different
    batch sizes. The context coefficient is fitted only when the decode points vary the context
    independently of the batch size; otherwise it is 0 and the batch term absorbs it.
    """
    prefill = [p for p in points if p.num_prefill_tokens > 0 and p.num_decode_seqs == 0]
    decode = [p for p in points if p.num_prefill_tokens == 0 and p.num_decode_seqs > 0]
    pre = _lstsq([[1.0, p.num_prefill_tokens] for p in prefill], prefill, "prefill lengths")
    rows = [[1.0, p.num_decode_seqs, p.num_context_tokens] for p in decode]
    if len(decode) < 3 or np.linalg.matrix_rank(np.array(rows)) < 3:
        dec = [*_lstsq([r[:2] for r in rows], decode, "decode batch sizes"), 0.0]
    else:
        dec = _lstsq(rows, decode, "decode batch sizes")
    c = [max(0.0, float(x)) for x in (*pre, *dec)]
    return LatencyProfile(model=model, source=source, prefill_ms_base=c[0],
                          prefill_ms_per_token=c[1], decode_ms_base=c[2], decode_ms_per_seq=c[3],
                          decode_ms_per_context_token=c[4], kv_bytes_per_token=kv_bytes_per_token,
                          points=tuple(points))


def _lstsq(rows: list[list[float]], points: list[ProfilePoint], what: str) -> list[float]:
    a = np.array(rows, dtype=np.float64)
    if len(rows) < 2 or np.linalg.matrix_rank(a) < a.shape[1]:
        raise ConfigError(f"cannot fit the latency profile: measure at least two different "
                          f"{what}")
    y = np.array([p.step_ms for p in points], dtype=np.float64)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [float(x) for x in coef]


def fit_error(profile: LatencyProfile, points: list[ProfilePoint]) -> float:
    """Root-mean-square relative error of the modelled step times over `points`."""
    if not points:
        return 0.0
    errors = [(profile.step_ms(p.num_prefill_tokens, p.num_decode_seqs, p.num_context_tokens)
               - p.step_ms) / p.step_ms for p in points]
    return float(np.sqrt(np.mean(np.square(errors))))


PROFILES_DIR = Path(__file__).parent / "profiles"


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped with Strata (`strata/sim/profiles/*.json`)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> LatencyProfile:
    """`--simulate` argument: a profile JSON file, or the name of a bundled profile."""
    path = Path(name_or_path)
    if path.is_file():
        return LatencyProfile.load(path)
    if name_or_path in bundled_profiles():
        return LatencyProfile.load(PROFILES_DIR / f"{name_or_path}.json")
    raise ConfigError(f"{name_or_path}: no such profile file, and not a bundled profile "
                      f"(bundled: {', '.join(bundled_profiles()) or 'none'}); make one with "
                      "`strata profile MODEL --out profile.json`")
