"""The dashboard's per-second ring and the instances' counters behind its decode charts, on an
injected clock: exact slots, exact rates, restarts and reads that fail."""

from __future__ import annotations

import asyncio

import httpx

from strata.gateway.control.dashboard.scrape import CounterReader, InstanceCounters, parse_counters
from strata.gateway.control.dashboard.series import LiveSeries
from strata.gateway.routing.instances import DEAD, InstanceView


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def view(instance_id: str, **fields: object) -> InstanceView:
    return InstanceView(instance_id, f"http://{instance_id}", "m", **fields)


def test_attempts_land_in_their_second_and_the_window_ends_at_the_last_complete_one() -> None:
    clock = Clock(100.2)
    series = LiveSeries(num_slots=8, clock=clock)
    series.observe(view("a"), False, 0.010)
    series.observe(view("a"), False, 0.030)
    series.observe(view("a"), True, None)
    clock.now = 101.9
    series.observe(view("b"), False, 0.005)
    clock.now = 102.0  # second 102 is still filling: not shown
    series.observe(view("b"), False, 0.5)
    columns = series.window(4)  # from the second the series started in
    assert columns["t"] == [100, 101]
    assert columns["answers_per_s"] == [2, 1]
    assert columns["failures_per_s"] == [1, 0]
    assert columns["ttft_ms_mean"] == [20.0, 5.0]
    assert columns["ttft_ms_max"] == [30.0, 5.0]
    assert columns["itl_ms_mean"] == [None] * 2 and columns["output_tokens_per_s"] == [None] * 2
    clock.now = 103.5
    assert series.window(2)["t"] == [101, 102]


def test_a_slot_is_reused_for_a_new_second_and_never_shows_an_old_one() -> None:
    clock = Clock(10.5)
    series = LiveSeries(num_slots=4, clock=clock)
    series.observe(view("a"), False, 0.1)
    clock.now = 14.5  # the same slot (14 % 4 == 10 % 4), four seconds later
    series.observe(view("a"), False, 0.2)
    series.observe(view("a"), False, 0.2)
    clock.now = 15.0
    columns = series.window(10)  # at most num_slots - 1 complete seconds exist
    assert columns["t"] == [12, 13, 14]
    assert columns["answers_per_s"] == [0, 0, 2]
    assert columns["ttft_ms_mean"] == [None, None, 200.0]


def test_a_decode_interval_is_written_to_every_second_it_covers() -> None:
    clock = Clock(0.0)
    series = LiveSeries(num_slots=16, clock=clock)
    clock.now = 20.0
    series.record_decode(10.4, 12.4, num_tokens=300.0, itl_s=0.025)  # seconds 11 and 12
    series.record_decode(12.4, 12.9, num_tokens=99.0, itl_s=0.5)  # ends inside 12: no second
    series.record_decode(12.9, 13.4, num_tokens=10.0, itl_s=None)  # second 13
    series.record_decode(0.0, 11.0, num_tokens=1e6, itl_s=1.0)  # too long: a baseline only
    columns = series.window(11)
    assert columns["t"][0] == 9
    assert columns["output_tokens_per_s"][:6] == [None, None, 150.0, 150.0, 20.0, None]
    assert columns["itl_ms_mean"][:6] == [None, None, 25.0, 25.0, None, None]


METRICS = """# HELP strata:generation_tokens_total Generated tokens.
# TYPE strata:generation_tokens_total counter
strata:generation_tokens_total{model_name="m"} 120.0
strata:generation_tokens_created{model_name="m"} 1.7e+09
strata:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 3.0
strata:time_per_output_token_seconds_sum{model_name="m"} 0.09
strata:time_per_output_token_seconds_count{model_name="m"} 4.0
strata:prefix_cache_hit_rate{model_name="m"} 0.25
strata:num_requests_running{model_name="m"} 1.0
"""


def test_the_counters_are_read_from_the_exposition_text() -> None:
    assert parse_counters(METRICS) == InstanceCounters(120.0, 0.09, 4.0, 0.25)
    assert parse_counters("") == InstanceCounters(0.0, 0.0, 0.0, None)
    assert parse_counters("strata:generation_tokens_total{x} oops\n") == InstanceCounters()


def metrics_text(tokens: float, itl_sum_s: float, num_itl: float, hit_rate: float) -> str:
    return (f'strata:generation_tokens_total{{model_name="m"}} {tokens}\n'
            f'strata:time_per_output_token_seconds_sum{{model_name="m"}} {itl_sum_s}\n'
            f'strata:time_per_output_token_seconds_count{{model_name="m"}} {num_itl}\n'
            f'strata:prefix_cache_hit_rate{{model_name="m"}} {hit_rate}\n')


def test_reads_add_the_growth_of_every_instance_and_count_a_restart_from_zero() -> None:
    answers = {"a": metrics_text(100, 1.0, 10, 0.5), "b": metrics_text(50, 0.5, 5, 0.0)}
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        text = answers.get(request.url.host)
        return httpx.Response(200, text=text) if text else httpx.Response(503)

    clock = Clock(990.0)
    series = LiveSeries(num_slots=32, clock=clock)
    clock.now = 1000.2
    views = [view("a"), view("b"), view("c", state=DEAD)]

    async def story() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            reader = CounterReader(client, series, clock=clock, min_interval_s=1.0)
            await reader.read(views)  # the baseline
            assert reader.prefix_hit_rate("a") == 0.5 and reader.prefix_hit_rate("c") is None
            clock.now = 1000.7
            await reader.read(views)  # too soon: nothing is asked
            assert calls == ["a", "b"]
            clock.now = 1002.2
            answers["a"] = metrics_text(160, 1.3, 13, 0.75)
            answers["b"] = metrics_text(20, 0.2, 2, 0.0)  # restarted: 20 since then
            await reader.read(views)
            clock.now = 1003.2
            del answers["b"]  # b fails: a alone counts, b's baseline is dropped
            answers["a"] = metrics_text(170, 1.3, 13, 0.75)
            await reader.read(views)
            assert set(reader.last) == {"a"}

    asyncio.run(story())
    clock.now = 1004.0
    columns = series.window(4)
    assert columns["t"] == [1000, 1001, 1002, 1003]
    assert columns["output_tokens_per_s"] == [None, 40.0, 40.0, 10.0]  # (60 + 20) / 2 s
    assert columns["itl_ms_mean"] == [None, 100.0, 100.0, None]  # (0.3 + 0.2) / (3 + 2)


def test_the_slowest_first_bytes_of_the_window_are_kept_with_their_request_ids() -> None:
    from strata.protocol.request_id import set_request_id

    clock = Clock(100.0)
    series = LiveSeries(num_slots=10, clock=clock, num_slowest=2)
    for request_id, ttft_s in (("r1", 0.5), ("r2", 0.1), ("r3", 0.9), ("r4", 0.2)):
        set_request_id(request_id)
        series.observe(view("a"), False, ttft_s)
        clock.now += 1
    set_request_id(None)
    assert [(s.request_id, s.ttft_s, s.trace_id) for s in series.slowest()] == [
        ("r3", 0.9, None), ("r1", 0.5, None)]  # tracing off: no trace id
    clock.now = 111.0  # r1 (at 100) left the 10 s window, r3 (at 102) did not
    set_request_id("r5")
    try:
        series.observe(view("b"), False, 0.05)  # faster than both, but r1's place is free
    finally:
        set_request_id(None)  # the id is the process's context: no other test's
    assert [(s.request_id, s.instance_id) for s in series.slowest()] == [("r3", "a"), ("r5", "b")]
    assert series.slowest()[0].to_json()["ttft_ms"] == 900.0
