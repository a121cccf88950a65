"""The load generator's maths, workloads and request flow against a fake server (MockTransport)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from typing import Any

import httpx
import pytest

from strata.bench.loadgen import BenchConfig, poisson_arrivals, run_benchmark, run_closed_loop
from strata.bench.report import (
    RequestResult,
    format_table,
    json_safe,
    latency_stats_ms,
    percentile,
    summarize,
)
from strata.bench.workloads import build_fixed, build_multi_turn, build_shared_prefix
from strata.errors import ConfigError

# --- percentiles and the summary ----------------------------------------------------------------


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 90) == pytest.approx(46.0)
    assert percentile([float(i) for i in range(101)], 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert math.isnan(percentile([], 50))


def test_latency_stats_are_in_milliseconds() -> None:
    assert latency_stats_ms([0.25, 0.5, 0.75, 1.0]) == {
        "mean": 625.0, "p50": 625.0, "p90": pytest.approx(925.0), "p99": pytest.approx(992.5)
    }


def test_tpot_excludes_the_first_token() -> None:
    assert RequestResult(output_tokens=5, ttft_s=0.25, e2e_s=1.25).tpot_s == 0.25
    assert RequestResult(output_tokens=1, ttft_s=0.25, e2e_s=0.25).tpot_s is None
    assert RequestResult(output_tokens=3, ttft_s=None, e2e_s=1.0).tpot_s is None


def test_summary_counts_failures_and_leaves_them_out_of_latencies() -> None:
    results = [
        RequestResult(prompt_tokens=10, output_tokens=5, ttft_s=0.25, itl_s=[0.25] * 4,
                      e2e_s=1.25),
        RequestResult(prompt_tokens=30, output_tokens=3, ttft_s=0.5, itl_s=[0.125, 0.375],
                      e2e_s=1.0),
        RequestResult(error="HTTP 503: busy", e2e_s=9.0),
        RequestResult(error="HTTP 503: busy", e2e_s=9.0),
    ]
    summary = summarize(results, duration_s=2.0)
    assert summary["num_requests"] == 4
    assert summary["num_completed"] == 2
    assert summary["num_failures"] == 2
    assert summary["errors"] == {"HTTP 503: busy": 2}
    assert summary["total_input_tokens"] == 40 and summary["total_output_tokens"] == 8
    assert summary["requests_per_s"] == 1.0
    assert summary["input_tokens_per_s"] == 20.0
    assert summary["output_tokens_per_s"] == 4.0
    assert summary["ttft_ms"]["p50"] == 375.0
    assert summary["tpot_ms"]["mean"] == 250.0  # (1.25-0.25)/4 and (1.0-0.5)/2
    assert summary["itl_ms"]["p50"] == 250.0  # 0.125, 0.25 x4, 0.375
    assert summary["e2e_ms"]["p50"] == 1125.0


def test_a_run_of_only_failures_reports_nan_as_null() -> None:
    summary = summarize([RequestResult(error="boom")], duration_s=1.0)
    assert math.isnan(summary["ttft_ms"]["p50"])
    encoded = json.dumps(json_safe(summary), allow_nan=False)
    assert json.loads(encoded)["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert "error x1: boom" in format_table(summary)


# --- workloads ----------------------------------------------------------------------------------


def test_fixed_workload_has_the_requested_shape_and_is_reproducible() -> None:
    items = build_fixed(5, 12, 7, [3, 4, 5], seed=1)
    assert [len(i.prompt_token_ids) for i in items] == [12] * 5
    assert {i.output_len for i in items} == {7}
    assert {t for i in items for t in i.prompt_token_ids} <= {3, 4, 5}
    assert items == build_fixed(5, 12, 7, [3, 4, 5], seed=1)
    assert items != build_fixed(5, 12, 7, [3, 4, 5], seed=2)


def test_shared_prefix_workload_shares_exactly_the_prefix() -> None:
    items = build_shared_prefix(4, 100, 10, 3, list(range(1000)), seed=0)
    assert [len(i.prompt_token_ids) for i in items] == [110] * 4
    prefix = items[0].prompt_token_ids[:100]
    assert all(i.prompt_token_ids[:100] == prefix for i in items)
    assert len({tuple(i.prompt_token_ids[100:]) for i in items}) == 4


def test_multi_turn_workload_has_sessions_of_turns_of_words() -> None:
    sessions = build_multi_turn(3, 4, 6, 9, seed=0)
    assert len(sessions) == 3
    assert all(len(s.user_turns) == 4 and s.output_len == 9 for s in sessions)
    assert all(len(turn.split()) == 6 for s in sessions for turn in s.user_turns)


def test_an_empty_token_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="pool is empty"):
        build_fixed(1, 1, 1, [], seed=0)


def test_poisson_arrivals_start_at_zero_and_increase() -> None:
    times = poisson_arrivals(50, 10.0, seed=3)
    assert times[0] == 0.0 and len(times) == 50
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    assert times == poisson_arrivals(50, 10.0, seed=3)


def test_closed_loop_keeps_at_most_concurrency_in_flight_and_cancels_at_the_timeout() -> None:
    in_flight, peak, done, cancelled = 0, 0, [], []

    def job(i: int, sleep_s: float) -> Any:
        async def run() -> None:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await asyncio.sleep(sleep_s)
                done.append(i)
            except asyncio.CancelledError:
                cancelled.append(i)
                raise
            finally:
                in_flight -= 1
        return run

    jobs = [job(i, 0.01) for i in range(6)] + [job(6, 30.0)]
    asyncio.run(run_closed_loop(jobs, concurrency=2, timeout_s=0.5))
    assert (peak, sorted(done), cancelled, in_flight) == (2, [0, 1, 2, 3, 4, 5], [6], 0)
    asyncio.run(run_closed_loop([], concurrency=2, timeout_s=0.5))  # nothing to run: returns


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="unknown workload 'zipf'"):
        BenchConfig(workload="zipf")
    with pytest.raises(ConfigError, match="concurrency must be >= 1"):
        BenchConfig(concurrency=0)
    assert BenchConfig(workload="multi-turn", num_sessions=3, num_turns=5).num_expected == 15


# --- against a fake server ----------------------------------------------------------------------


def _sse(events: list[dict[str, Any]]) -> bytes:
    frames = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return "".join(frames).encode()


class FakeServer:
    """Streams `max_tokens` one-word chunks; refuses every request whose number is in `fail`."""

    def __init__(self, fail: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail = fail
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [11, 12, 13, 12], "count": 4})
        self.bodies.append(body)
        if len(self.bodies) in self.fail:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        n = body["max_tokens"]
        key = "text" if request.url.path == "/v1/completions" else "delta"
        chunks = [{"choices": [{"index": 0, key: "w " if key == "text" else {"content": "w "}}]}
                  for _ in range(n)]
        usage = {"choices": [], "usage": {"prompt_tokens": 99, "completion_tokens": n}}
        return httpx.Response(200, content=_sse(chunks + [usage]),
                              headers={"content-type": "text/event-stream"})


def _run(config: BenchConfig, server: FakeServer) -> dict[str, Any]:
    return asyncio.run(run_benchmark(config, transport=httpx.MockTransport(server)))


def test_fixed_run_sends_exact_prompts_and_counts_a_refusal_as_a_failure() -> None:
    server = FakeServer(fail={2})
    config = BenchConfig(url="http://fake", num_requests=4, input_len=6, output_len=3,
                         concurrency=1, show_progress=False)
    report = _run(config, server)
    assert report["model"] == "tiny"
    assert (report["num_completed"], report["num_failures"]) == (3, 1)
    assert report["errors"] == {"HTTP 503: busy": 1}
    assert report["total_output_tokens"] == 9 and report["total_input_tokens"] == 3 * 99
    assert all(len(b["prompt"]) == 6 and set(b["prompt"]) <= {11, 12, 13} for b in server.bodies)
    assert all(b["ignore_eos"] and b["stream"] and b["model"] == "tiny" for b in server.bodies)


def test_multi_turn_resends_the_history_and_skips_a_session_after_a_failure() -> None:
    server = FakeServer(fail={4})  # session 2, turn 1 (sessions run one at a time)
    config = BenchConfig(url="http://fake", workload="multi-turn", num_sessions=2, num_turns=3,
                         input_len=2, output_len=2, concurrency=1, show_progress=False)
    report = _run(config, server)
    assert [len(b["messages"]) for b in server.bodies] == [1, 3, 5, 1]
    assert server.bodies[1]["messages"][1] == {"role": "assistant", "content": "w w "}
    assert (report["num_completed"], report["num_failures"]) == (3, 3)
    assert report["errors"]["not sent: an earlier turn of its session failed"] == 2


def test_a_run_reports_requests_done_of_total(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata.progress")
    config = BenchConfig(url="http://fake", num_requests=3, input_len=2, output_len=1,
                         concurrency=1, show_progress=True)
    _run(config, FakeServer(fail={2}))  # a failed request is done too
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("requests: done, 3/3 req (100%) in ")
    caplog.clear()
    _run(dataclasses.replace(config, show_progress=False), FakeServer())
    assert caplog.records == []
