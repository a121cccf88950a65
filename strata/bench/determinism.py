"""`strata bench --check-determinism`: does a server give the same request the same tokens,
whatever its cache and its batch? Works against any OpenAI-compatible server (Strata, vLLM,
SGLang, llama.cpp's server), so a user can check Strata and its peers alike.

Each of `num_prompts` chat prompts (random words behind a nonce, so that the first send finds
nothing cached) is sent, greedy and then seeded (temperature 0.9, top_p 0.95, a seed per prompt):

    uncached   alone, the first time the server sees it
    cached     alone again: its prefix is now in the server's cache, if it has one
    batched    inside a batch of `batch_size` concurrent requests (the prompts themselves and
               filler prompts of other lengths), its prefix cached as well

and two cells are reported per mode, each "identical / prompts":

    cached vs uncached    only the cache differs (a prefix hit, chunk boundaries)
    batched vs cached     only the batch differs (batch-variant kernels, split reductions)

A prompt is identical when the answer's text and finish reason are the same. A request that
fails is counted as not identical and its error is kept in the report.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from strata.bench.loadgen import first_model
from strata.bench.workloads import random_words
from strata.errors import ConfigError
from strata.progress import progress
from strata.protocol.keys import auth_header

MODES = ("greedy", "seeded")
SEEDED = {"temperature": 0.9, "top_p": 0.95}
CELLS = (("cached", "uncached"), ("batched", "cached"))


@dataclass(frozen=True, slots=True)
class DeterminismConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 12
    prompt_words: int = 40  # about 48 tokens with a chat template around them
    output_len: int = 48
    batch_size: int = 36
    seed: int = 0
    timeout_s: float = 600.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in ("num_prompts", "prompt_words", "output_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_requests(self) -> int:
        """What a run sends: per mode, each prompt alone twice and one batch."""
        return len(MODES) * (2 * self.num_prompts + max(self.batch_size, self.num_prompts))


@dataclass(slots=True)
class Cell:
    """How many prompts gave identical answers under two conditions, and which did not."""

    identical: int = 0
    total: int = 0
    differing: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.identical} / {self.total}"


Answer = tuple[str, str] | str  # (text, finish reason), or the error


async def check_determinism(config: DeterminismConfig, *,
                            transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """Runs the check against `config.url`; the JSON-ready report."""
    async with httpx.AsyncClient(base_url=config.url, headers=auth_header(config.api_key),
                                 transport=transport,
                                 timeout=httpx.Timeout(config.timeout_s, connect=10.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        try:
            model = config.model or await first_model(client)
        except httpx.HTTPError as exc:
            raise ConfigError(f"cannot reach {config.url} ({exc}); is a server running there? "
                              "(--url)") from None
        rng = random.Random(config.seed)
        nonce = secrets.token_hex(4)  # a fresh run finds none of its prompts cached
        cells: dict[str, dict[str, Cell]] = {}
        errors: list[str] = []
        with progress(config.num_requests, "determinism check", unit="req",
                      enabled=config.show_progress) as bar:
            for mode in MODES:
                prompts = [f"[{nonce}-{mode}-{i}] {random_words(rng, config.prompt_words)}"
                           for i in range(config.num_prompts)]
                fillers = [random_words(rng, rng.randint(5, 2 * config.prompt_words))
                           for _ in range(max(0, config.batch_size - config.num_prompts))]
                runs = await _one_mode(client, model, mode, prompts, fillers, config, bar.update)
                cells[mode] = {f"{a} vs {b}": _compare(runs[a], runs[b]) for a, b in CELLS}
                errors += [a for run in runs.values() for a in run if isinstance(a, str)]
    return {"model": model, "config": {k: v for k, v in asdict(config).items()
                                       if k != "api_key"},
            "cells": {mode: {name: asdict(cell) for name, cell in row.items()}
                      for mode, row in cells.items()},
            "all_identical": all(c.identical == c.total for row in cells.values()
                                 for c in row.values()),
            "errors": errors[:20]}


async def _one_mode(client: httpx.AsyncClient, model: str, mode: str, prompts: list[str],
                    fillers: list[str], config: DeterminismConfig,
                    step: Any) -> dict[str, list[Answer]]:
    async def ask(i: int, prompt: str) -> Answer:
        body: dict[str, Any] = {"model": model, "max_tokens": config.output_len,
                                "messages": [{"role": "user", "content": prompt}]}
        if mode == "greedy":
            body["temperature"] = 0
        else:
            body.update(SEEDED, seed=config.seed * 1_000 + i)
        try:
            response = await client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            step(1)
        if response.status_code != 200:
            return f"{response.status_code}: {response.text[:200]}"
        choice = response.json()["choices"][0]
        return str(choice["message"].get("content") or ""), str(choice.get("finish_reason"))

    uncached = [await ask(i, p) for i, p in enumerate(prompts)]
    cached = [await ask(i, p) for i, p in enumerate(prompts)]
    together = await asyncio.gather(*[ask(i, p) for i, p in enumerate(prompts)],
                                    *[ask(len(prompts) + j, f) for j, f in enumerate(fillers)])
    return {"uncached": uncached, "cached": cached, "batched": list(together[:len(prompts)])}


def _compare(first: list[Answer], second: list[Answer]) -> Cell:
    cell = Cell(total=len(first))
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if isinstance(a, tuple) and a == b:
            cell.identical += 1
        else:
            cell.differing.append(i)
    return cell


def format_determinism(report: dict[str, Any]) -> str:
    """The report as the table the README shows."""
    names = [f"{a} vs {b}" for a, b in CELLS]
    lines = [f"determinism of {report['model']} ({report['config']['url']}): identical answers",
             f"{'':<22}" + "".join(f"{mode:>12}" for mode in MODES)]
    for name in names:
        row = [report["cells"][mode][name] for mode in MODES]
        lines.append(f"{name:<22}" + "".join(f"{c['identical']:>6} / {c['total']:<3}"
                                              for c in row))
    if report["errors"]:
        lines.append(f"{len(report['errors'])} request(s) failed, e.g. {report['errors'][0]}")
    return "\n".join(lines)


__all__ = ["DeterminismConfig", "check_determinism", "format_determinism"]
