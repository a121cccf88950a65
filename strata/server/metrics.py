"""Prometheus metrics of one server, on its own `CollectorRegistry` (never the global one).

Per-request histograms and counters are recorded by the routes as outputs arrive; gauges and the
preemption counter are refreshed from `AsyncEngine.stats()` at scrape time.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from strata.clock import Clock
from strata.engine.outputs import EngineStats, RequestOutput

if TYPE_CHECKING:
    from strata.model.parallel.pipeline import PipelineStats
    from strata.state.sessions import WriteBehindStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The `strata:*` metrics of one server."""

    def __init__(self, model_name: str, *, simulated: bool = False) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        reg = self.registry
        Gauge("strata:simulated", "1 when a latency model stands in for the model (simulated).",
              registry=reg).set(1 if simulated else 0)
        self.ttft = Histogram("strata:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.tpot = Histogram("strata:time_per_output_token_seconds",
                              "Mean time per output token after the first.", labels,
                              buckets=_TOKEN_BUCKETS_S, registry=reg)
        self.e2e = Histogram("strata:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.running = Gauge("strata:num_requests_running", "Requests running.", labels,
                             registry=reg)
        self.waiting = Gauge("strata:num_requests_waiting", "Requests waiting.", labels,
                             registry=reg)
        self.kv_usage = Gauge("strata:kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                              labels, registry=reg)
        self.hit_rate = Gauge("strata:prefix_cache_hit_rate",
                              "Prompt tokens served by the prefix cache / looked up.", labels,
                              registry=reg)
        self.prompt_tokens = Counter("strata:prompt_tokens_total", "Prompt tokens of requests.",
                                     labels, registry=reg)
        self.generation_tokens = Counter("strata:generation_tokens_total", "Generated tokens.",
                                         labels, registry=reg)
        self.preemptions = Counter("strata:num_preemptions_total", "Preemptions.", labels,
                                   registry=reg)
        self.success = Counter("strata:request_success_total", "Finished requests.",
                               [*labels, "finish_reason"], registry=reg)
        self.cancelled = Counter("strata:requests_cancelled",
                                 "Client requests cancelled before their answer was whole, their "
                                 "engine requests aborted, by reason (client_disconnect, "
                                 "deadline).", [*labels, "reason"], registry=reg)
        for reason in ("client_disconnect", "deadline"):
            self.cancelled.labels(model_name, reason)
        self._seen_preemptions = 0
        self.kv = KVOffloadMetrics(reg, model_name)
        self.lora = LoraMetrics(reg, model_name)
        self.ranks: RankMemoryMetrics | None = None
        self.pipeline: PipelineMetrics | None = None
        self.session_writes: SessionWriteMetrics | None = None

    def watch_ranks(self, source: Callable[[], Iterable[tuple[int, int, int]]],
                    pipeline: Callable[[], PipelineStats] | None = None) -> None:
        """Report a parallel instance's (rank, weight bytes, KV bytes) at every scrape, and
        its stages and communication when `pipeline` is given."""
        self.ranks = RankMemoryMetrics(self.registry, self._model, source)
        if pipeline is not None:
            self.pipeline = PipelineMetrics(self.registry, self._model, pipeline)

    def watch_session_writes(self, source: Callable[[], WriteBehindStats]) -> None:
        """Report the session write-behind queue (session/eventual levels) at every scrape."""
        self.session_writes = SessionWriteMetrics(self.registry, self._model, source)

    def observe_cancelled(self, reason: str) -> None:
        self.cancelled.labels(self._model, reason).inc()

    def observe_finished(self, timing: RequestTiming, output: RequestOutput) -> None:
        """Record one finished request."""
        model = self._model
        reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
        self.success.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(output.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(output.num_output_tokens)
        e2e_s = timing.finish_s - timing.arrival_s
        self.e2e.labels(model).observe(e2e_s)
        if timing.first_token_s is not None:
            self.ttft.labels(model).observe(timing.first_token_s - timing.arrival_s)
            if output.num_output_tokens > 1:
                decode_s = timing.finish_s - timing.first_token_s
                self.tpot.labels(model).observe(decode_s / (output.num_output_tokens - 1))

    def refresh(self, stats: EngineStats) -> None:
        """Copy an engine snapshot into the gauges (called at scrape time)."""
        model = self._model
        self.running.labels(model).set(stats.num_running)
        self.waiting.labels(model).set(stats.num_waiting)
        self.kv_usage.labels(model).set(stats.kv_usage)
        self.hit_rate.labels(model).set(stats.prefix_hit_rate)
        if stats.num_preemptions > self._seen_preemptions:
            self.preemptions.labels(model).inc(stats.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = stats.num_preemptions
        self.kv.refresh(stats)
        if self.ranks is not None:
            self.ranks.refresh()
        if self.pipeline is not None:
            self.pipeline.refresh()
        if self.session_writes is not None:
            self.session_writes.refresh()

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, gauges refreshed from `stats`."""
        self.refresh(stats)
        return generate_latest(self.registry)


class KVOffloadMetrics:
    """`strata:kv_*`: KV blocks fetched from and published to the external store."""

    def __init__(self, reg: CollectorRegistry, model_name: str) -> None:
        def counter(name: str, doc: str) -> Counter:
            made = Counter(f"strata:kv_{name}", doc, ["model_name"], registry=reg)
            made.labels(model_name)  # shown (as 0) before the first event
            return made

        self.fetched_blocks = counter("fetched_blocks_total", "KV blocks fetched from the store.")
        self.fetched_bytes = counter("fetched_bytes_total", "Bytes of KV fetched from the store.")
        self.fetch_errors = counter("fetch_errors_total", "Fetches that failed (store down).")
        self.fetch_s = Histogram("strata:kv_fetch_seconds", "Time to fetch a prompt's KV.",
                                 ["model_name"], buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.published_blocks = counter("published_blocks_total", "KV blocks written.")
        self.published_bytes = counter("published_bytes_total", "Bytes of KV written.")
        self.publish_errors = counter("publish_errors_total",
                                      "Publishes that failed or were dropped (backlog full).")
        self.decode_failures = counter("decode_failures_total",
                                       "Fetched blocks refused (other layout, bad checksum).")
        self.external_hit_tokens = counter("external_hit_tokens_total",
                                           "Prompt tokens served by fetched KV.")
        self._model = model_name
        self._seen = (0, 0)

    def refresh(self, stats: EngineStats) -> None:
        failures, hits = self._seen
        self.decode_failures.labels(self._model).inc(
            max(0, stats.num_kv_import_failures - failures))
        self.external_hit_tokens.labels(self._model).inc(
            max(0, stats.num_external_hit_tokens - hits))
        self._seen = (stats.num_kv_import_failures, stats.num_external_hit_tokens)


class LoraMetrics:
    """`strata:lora_*`: the LoRA adapters resident (--max-cpu-loras), loaded and evicted
    (strata/server/loras.py sets them)."""

    def __init__(self, reg: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.resident = Gauge("strata:lora_resident_adapters",
                              "LoRA adapters whose weights the engine holds.", labels, registry=reg)
        self.resident_bytes = Gauge("strata:lora_resident_bytes",
                                    "Bytes of the resident LoRA adapters' weights.", labels,
                                    registry=reg)
        self.loads = Counter("strata:lora_loads", "LoRA adapters loaded from their files "
                             "(at run time: on demand or by the load route).", labels,
                             registry=reg)
        self.evictions = Counter("strata:lora_evictions", "Resident LoRA adapters evicted to "
                                 "make room (--max-cpu-loras).", labels, registry=reg)
        self.load_s = Histogram("strata:lora_load_seconds", "Time to read, check and add a "
                                "LoRA adapter.", labels, buckets=_LATENCY_BUCKETS_S, registry=reg)
        for metric in (self.resident, self.resident_bytes, self.loads, self.evictions):
            metric.labels(model_name)  # shown (as 0) before the first event


class SessionWriteMetrics:
    """`strata:session_write_*`: turns acknowledged but not yet in the session store (the
    session/eventual levels, strata/state/sessions/write_behind.py): what a crash would lose."""

    def __init__(self, reg: CollectorRegistry, model_name: str,
                 source: Callable[[], WriteBehindStats]) -> None:
        labels = ["model_name", "level"]
        self._source, self._model = source, model_name
        self.pending = Gauge("strata:session_write_pending", "Acknowledged turns not yet "
                             "written to the session store.", labels, registry=reg)
        self.lag = Gauge("strata:session_write_lag_seconds", "Age of the oldest acknowledged "
                         "turn not yet written (0: none).", labels, registry=reg)
        self.bound = Gauge("strata:session_write_bound_seconds", "The lag past which a turn "
                           "is refused (session level; -1: no bound).", labels, registry=reg)
        self.outcomes = Counter("strata:session_write_turns", "Turns by outcome: flushed, "
                                "lost (refused by the store, or unwritten at close), refused "
                                "(503: queue full or lag past the bound).",
                                [*labels, "outcome"], registry=reg)
        self._seen: dict[str, int] = {}
        self.refresh()

    def refresh(self) -> None:
        stats = self._source()
        labels = (self._model, stats.level)
        self.pending.labels(*labels).set(stats.num_pending)
        self.lag.labels(*labels).set(stats.lag_s)
        self.bound.labels(*labels).set(-1 if stats.bound_s is None else stats.bound_s)
        for outcome, count in (("flushed", stats.num_flushed), ("lost", stats.num_lost),
                               ("refused", stats.num_refused)):
            self.outcomes.labels(*labels, outcome).inc(count - self._seen.get(outcome, 0))
            self._seen[outcome] = count


class RankMemoryMetrics:
    """`strata:rank_weight_bytes{rank}`, `strata:rank_kv_bytes{rank}` of a parallel instance."""

    def __init__(self, reg: CollectorRegistry, model_name: str,
                 source: Callable[[], Iterable[tuple[int, int, int]]]) -> None:
        labels = ["model_name", "rank"]
        self.weight_bytes = Gauge("strata:rank_weight_bytes", "Bytes of weights a rank holds.",
                                  labels, registry=reg)
        self.kv_bytes = Gauge("strata:rank_kv_bytes", "Bytes of KV cache a rank holds.", labels,
                              registry=reg)
        self._model = model_name
        self._source = source
        self.refresh()

    def refresh(self) -> None:
        for rank, weight_bytes, kv_bytes in self._source():
            self.weight_bytes.labels(self._model, str(rank)).set(weight_bytes)
            self.kv_bytes.labels(self._model, str(rank)).set(kv_bytes)


class PipelineMetrics:
    """A parallel instance's stages and collectives, between two scrapes:
    `strata:stage_busy_fraction{stage}` (time the stage computed / time some batch was in
    flight: near 1 for every stage when the stages overlap, about 1/P when they take turns),
    `strata:step_comm_seconds` (rank 0's time in collectives per step), and the counters behind
    them (`strata:stage_busy_seconds_total{stage}`, `strata:parallel_comm_seconds_total`)."""

    def __init__(self, reg: CollectorRegistry, model_name: str,
                 source: Callable[[], PipelineStats]) -> None:
        stage = ["model_name", "stage"]
        self.busy_fraction = Gauge("strata:stage_busy_fraction",
                                   "Share of the time with batches in flight that a pipeline "
                                   "stage computed, since the previous scrape.", stage,
                                   registry=reg)
        self.busy_s = Counter("strata:stage_busy_seconds", "Time a pipeline stage computed.",
                              stage, registry=reg)
        self.step_comm_s = Gauge("strata:step_comm_seconds",
                                 "Rank 0's time inside collectives per step, since the previous "
                                 "scrape.", ["model_name"], registry=reg)
        self.comm_s = Counter("strata:parallel_comm_seconds",
                              "Rank 0's time inside collectives.", ["model_name"], registry=reg)
        self._model = model_name
        self._source = source
        self._before = source()
        self.refresh()

    def refresh(self) -> None:
        now, before, model = self._source(), self._before, self._model
        for stage, fraction in enumerate(now.busy_fractions(before)):
            self.busy_fraction.labels(model, str(stage)).set(fraction)
            self.busy_s.labels(model, str(stage)).inc(
                max(0.0, now.stage_busy_s[stage] - before.stage_busy_s[stage]))
        self.step_comm_s.labels(model).set(now.comm_s_per_step(before))
        self.comm_s.labels(model).inc(max(0.0, now.comm_s - before.comm_s))
        self._before = now


@dataclass(slots=True)
class RequestTiming:
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float = 0.0


async def track(outputs: AsyncGenerator[RequestOutput, None], metrics: ServerMetrics,
                arrival_s: float, clock: Clock
                ) -> AsyncGenerator[RequestOutput, None]:
    """Pass `outputs` through, recording TTFT, TPOT, latency and counts when it finishes.

    Closing this generator closes `outputs` at once (which aborts an unfinished request).
    """
    timing = RequestTiming(arrival_s)
    try:
        async for output in outputs:
            if timing.first_token_s is None and output.new_token_ids:
                timing.first_token_s = clock()
            if output.finished:
                timing.finish_s = clock()
                metrics.observe_finished(timing, output)
            yield output
    finally:
        await outputs.aclose()


__all__ = ["KVOffloadMetrics", "LoraMetrics", "PipelineMetrics", "RankMemoryMetrics",
           "RequestTiming", "ServerMetrics", "track"]
