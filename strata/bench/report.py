"""Per-request measurements and the summary a benchmark run reports.

Times are measured in seconds and reported in milliseconds (`*_ms`). TPOT of one request is
(e2e - ttft) / (output_tokens - 1); ITL is every gap between two streamed chunks, pooled over
all requests. Failed requests are counted and excluded from the latency statistics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """What one request measured. `error` is set when it failed."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    Returns NaN for an empty sequence.
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 of a list of seconds, in milliseconds."""
    stats = {"mean": sum(values_s) / len(values_s) * 1000.0 if values_s else math.nan}
    for q in PERCENTILES:
        stats[f"p{q}"] = percentile(values_s, q) * 1000.0
    return stats


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """The JSON-ready summary of a run that lasted `duration_s` seconds."""
    ok = [r for r in results if r.is_ok]
    num_input = sum(r.prompt_tokens for r in ok)
    num_output = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failures": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "requests_per_s": per_s(len(ok)),
        "input_tokens_per_s": per_s(num_input),
        "output_tokens_per_s": per_s(num_output),
        "ttft_ms": latency_stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_stats_ms([r.e2e_s for r in ok]),
        "errors": _error_counts(results),
    }


def _error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            counts[r.error] = counts.get(r.error, 0) + 1
    return counts


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table of the summary for the terminal."""
    lines = [
        f"{'requests':<22}{summary['num_completed']} ok, {summary['num_failures']} failed"
        f" in {summary['duration_s']:.2f} s",
        f"{'requests/s':<22}{summary['requests_per_s']:.2f}",
        f"{'input tokens/s':<22}{summary['input_tokens_per_s']:.1f}",
        f"{'output tokens/s':<22}{summary['output_tokens_per_s']:.1f}",
        f"{'':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        cells = "".join(f"{s[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{key.replace('_ms', ' (ms)').upper():<22}{cells}")
    for error, count in summary["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """Replace NaN (a statistic of no samples) by None so the report is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write the report as strict JSON (NaN as null)."""
    path.write_text(json.dumps(json_safe(report), indent=2, allow_nan=False) + "\n")
