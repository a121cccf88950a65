"""An async load generator for any OpenAI-compatible server (Strata, vLLM, a router).

It streams every request and measures TTFT, the gaps between streamed chunks (ITL), TPOT and
end-to-end latency. Load is either a concurrency limit (closed loop) or a Poisson request rate
(open loop). A run is bounded in count and in time (`timeout_s`); a request that fails is
recorded as a failure and never stops the run. It talks only to `config.url`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from strata.bench.report import RequestResult, summarize
from strata.bench.workloads import (
    WORKLOADS,
    ChatSession,
    CompletionItem,
    build_fixed,
    build_multi_turn,
    build_shared_prefix,
    random_words,
)
from strata.clients.sse import chunk_text, error_message, iter_json_events
from strata.errors import ConfigError
from strata.progress import progress
from strata.protocol.keys import auth_header

Job = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run. `request_rate` (requests/s) replaces the concurrency limit when set."""

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    workload: str = "fixed"
    num_requests: int = 32
    input_len: int = 128
    output_len: int = 64
    prefix_len: int = 1000
    num_sessions: int = 8
    num_turns: int = 4
    concurrency: int = 8
    request_rate: float | None = None
    seed: int = 0
    timeout_s: float = 600.0
    show_progress: bool = True
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {self.workload!r}; choose one of {WORKLOADS}")
        for name in ("num_requests", "input_len", "output_len", "num_sessions", "num_turns",
                     "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ConfigError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ConfigError(f"request_rate must be positive, got {self.request_rate}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def num_expected(self) -> int:
        """How many HTTP requests the run sends (every turn of a session is one)."""
        if self.workload == "multi-turn":
            return self.num_sessions * self.num_turns
        return self.num_requests


async def run_benchmark(
    config: BenchConfig, *, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, Any]:
    """Run the workload against `config.url` and return the JSON-ready report."""
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None)  # the load policy bounds what is in flight
    headers = auth_header(config.api_key)
    async with httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=limits,
                                 headers=headers, transport=transport) as client:
        try:
            model = config.model or await first_model(client)
        except httpx.HTTPError as e:
            raise ConfigError(f"cannot reach {config.url} ({e}); is a server running there? "
                              "(--url)") from None
        results: list[RequestResult] = []
        with progress(config.num_expected, "requests", unit="req",
                      enabled=config.show_progress) as bar:
            def record(result: RequestResult) -> None:
                results.append(result)
                bar.update(1)

            jobs = await _build_jobs(client, config, model, record)
            start = time.perf_counter()
            await _drive(jobs, config)
            duration_s = time.perf_counter() - start
    missing = config.num_expected - len(results)
    results += [RequestResult(error="not finished within --timeout-s")] * missing
    described = {k: v for k, v in asdict(config).items() if k != "api_key"}
    return {"model": model, "config": described, **summarize(results, duration_s)}


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model id that the server lists at /v1/models."""
    resp = await client.get("/v1/models")
    if resp.status_code != 200:
        raise ConfigError(f"{client.base_url}/v1/models answered {resp.status_code}: "
                          f"{resp.text[:200]} (a key: --api-key; or name the model: --model)")
    data = resp.json().get("data") or []
    if not data:
        raise ConfigError(f"{client.base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def token_pool(client: httpx.AsyncClient, model: str, seed: int) -> list[int]:
    """Distinct token ids of random words, from the server's /tokenize."""
    text = random_words(random.Random(seed), 256)
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    resp = await client.post("/tokenize", json=body)
    if resp.status_code != 200:
        raise ConfigError(f"{client.base_url}/tokenize answered {resp.status_code}: "
                          "the fixed and shared-prefix workloads need it")
    return sorted(set(resp.json()["tokens"]))


async def _build_jobs(
    client: httpx.AsyncClient, config: BenchConfig, model: str,
    record: Callable[[RequestResult], None],
) -> list[Job]:
    if config.workload == "multi-turn":
        sessions = build_multi_turn(config.num_sessions, config.num_turns, config.input_len,
                                    config.output_len, seed=config.seed)
        return [_session_job(client, model, s, record) for s in sessions]
    pool = await token_pool(client, model, config.seed)
    if config.workload == "fixed":
        items = build_fixed(config.num_requests, config.input_len, config.output_len, pool,
                            seed=config.seed)
    else:
        items = build_shared_prefix(config.num_requests, config.prefix_len, config.input_len,
                                    config.output_len, pool, seed=config.seed)
    return [_completion_job(client, model, item, record) for item in items]


def _completion_job(
    client: httpx.AsyncClient, model: str, item: CompletionItem,
    record: Callable[[RequestResult], None],
) -> Job:
    body = {"model": model, "prompt": item.prompt_token_ids, "max_tokens": item.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def job() -> None:
        result, _ = await stream_request(client, "/v1/completions", body)
        result.prompt_tokens = result.prompt_tokens or len(item.prompt_token_ids)
        record(result)

    return job


def _session_job(
    client: httpx.AsyncClient, model: str, session: ChatSession,
    record: Callable[[RequestResult], None],
) -> Job:
    async def job() -> None:
        history: list[dict[str, str]] = []
        for i, turn in enumerate(session.user_turns):
            history.append({"role": "user", "content": turn})
            body = {"model": model, "messages": list(history), "max_tokens": session.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            result, text = await stream_request(client, "/v1/chat/completions", body)
            record(result)
            if not result.is_ok:
                for _ in session.user_turns[i + 1:]:
                    record(RequestResult(error="not sent: an earlier turn of its session failed"))
                return
            history.append({"role": "assistant", "content": text})

    return job


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[RequestResult, str]:
    """Send one streaming request; return its measurements and the generated text."""
    result = RequestResult()
    pieces: list[str] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code == 200:
                await _read_stream(resp, result, pieces, start)
            else:
                await resp.aread()
                result.error = error_message(resp)
    except Exception as e:  # a failed request is data: the run goes on
        result.error = f"{type(e).__name__}: {e}"
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or len(pieces)
    return result, "".join(pieces)


async def _read_stream(
    resp: httpx.Response, result: RequestResult, pieces: list[str], start: float
) -> None:
    last = start
    async for event in iter_json_events(resp.aiter_bytes()):
        now = time.perf_counter()
        text = chunk_text(event)
        if text:
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            pieces.append(text)
        _read_usage(event, result)


def _read_usage(event: dict[str, Any], result: RequestResult) -> None:
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or 0)


async def _drive(jobs: list[Job], config: BenchConfig) -> None:
    """Run the jobs under the configured load until all finish or `timeout_s` passes."""
    if config.request_rate is None:
        await run_closed_loop(jobs, config.concurrency, config.timeout_s)
        return
    arrivals = poisson_arrivals(len(jobs), config.request_rate, config.seed)
    await _finish_within([asyncio.ensure_future(_at(delay, job))
                          for delay, job in zip(arrivals, jobs, strict=True)], config.timeout_s)


async def run_closed_loop(jobs: list[Job], concurrency: int, timeout_s: float) -> None:
    """Run the jobs, at most `concurrency` at a time; cancel those unfinished after `timeout_s`."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(job: Job) -> None:
        async with gate:
            await job()

    await _finish_within([asyncio.ensure_future(gated(job)) for job in jobs], timeout_s)


async def _finish_within(tasks: list[asyncio.Future[None]], timeout_s: float) -> None:
    if not tasks:
        return  # asyncio.wait refuses an empty set
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def _at(delay_s: float, job: Job) -> None:
    await asyncio.sleep(delay_s)
    await job()


def poisson_arrivals(num: int, rate_per_s: float, seed: int) -> list[float]:
    """Start times (s from the run's start) of `num` arrivals of a Poisson process."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate_per_s)
    return times
