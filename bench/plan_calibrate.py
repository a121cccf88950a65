"""The per-request overhead a plan charges, measured on the fleet about to be measured.

A plan times engine steps from a profile; everything else a request meets before the engine's
first step (the client's HTTP, the gateway's hop, JSON, tokenization, a session's store read and
compare-and-set, the processes' share of a loaded CPU) is `Costs.request_overhead_ms`. Instead of
a constant, `calibrate_overhead` sends a few requests one at a time through the same URL, of the
kind the workload sends (completions; or second turns of chat sessions, whose overhead includes
the session store), and keeps each request's TTFT less the engine time the profile gives its
uncached prompt (one prefill step on an idle engine); the first probe, a process's first
request, is a warm-up and not kept. The samples go to the plan whole
(`Costs.request_overhead_samples_ms`): each simulated request draws one, so the plan carries the
measured spread, which also breaks the lockstep a constant overhead gives identical sessions.

The probes use fresh random prompts (and fresh sessions), so they warm nothing the workload
reuses except a chat template's first tokens.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from typing import Any

import httpx

from strata.bench.workloads import random_words
from strata.clients.sse import chunk_text
from strata.sim.profile import LatencyProfile

NUM_PROBES = 8


async def calibrate_overhead(url: str, profile: LatencyProfile, *, is_chat: bool,
                             seed: int = 7) -> list[float]:
    """Overhead samples in ms (TTFT less modelled engine time), `NUM_PROBES` of them."""
    rng, run = random.Random(seed), uuid.uuid4().hex[:8]
    samples = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for k in range(NUM_PROBES + 1):  # the first is a warm-up (a process's first request)
            if is_chat:
                session = f"probe-{run}-{k}"
                await _probe(client, _chat(rng, session))  # turn 1 makes the session
                ttft_ms, uncached = await _probe(client, _chat(rng, session))
            else:
                ttft_ms, uncached = await _probe(client, _completion(rng))
            samples.append(max(0.0, ttft_ms - profile.step_ms(uncached, 0)))
    return samples[1:]


def describe(samples: list[float]) -> str:
    return (f"overhead median {statistics.median(samples):.1f} ms, "
            f"[{min(samples):.1f}-{max(samples):.1f}] over {len(samples)} probes")


def _completion(rng: random.Random) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": "m", "prompt": random_words(rng, 12), "max_tokens": 2}


def _chat(rng: random.Random, session: str) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": random_words(rng, 12)}],
        "max_tokens": 2, "session_id": session}


async def _probe(client: httpx.AsyncClient,
                 request: tuple[str, dict[str, Any]]) -> tuple[float, int]:
    """(TTFT in ms, uncached prompt tokens) of one streamed request."""
    path, body = request
    body = {**body, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft_ms, uncached = time.perf_counter(), None, 0
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft_ms is None and chunk_text(event):
                ttft_ms = (time.perf_counter() - start) * 1000
            usage = event.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                uncached = usage["prompt_tokens"] - cached
    if ttft_ms is None:
        raise RuntimeError(f"calibration probe to {path} streamed no token")
    return ttft_ms, uncached
