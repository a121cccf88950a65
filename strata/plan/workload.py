"""What `strata plan` is asked about: the workload and the SLO.

A workload is a list of *jobs*. A job is one conversation: a shared prefix (a tenant's system
prompt, or nothing) and one or more turns; turn k's prompt is turn k-1's prompt, its answer and
the new user tokens, so a multi-turn job re-reads its history as a real chat client does. A
single-turn workload is jobs of one turn. Jobs start as a Poisson process (`rate_per_s`
requests per second, divided by the turns per job) or `concurrency` at a time (closed loop: the
next job starts when one ends). Token ids are random (seeded): only their identity matters, for
the prefix cache.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.errors import ConfigError

VOCAB_SIZE = 49152  # the default model's; any size works, ids only need to repeat as prompts do
CHAT_TOKENS_PER_TURN = 5  # ChatML's role markers around a message (`strata bench` multi-turn)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token counts drawn uniformly from [low, high] (one value when low == high)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ConfigError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'128' (fixed) or '64:256' (uniform)."""
        low, _, high = text.partition(":")
        try:
            bounds = int(low), int(high or low)
        except ValueError:
            raise ConfigError(f"{text!r}: a length is N or LOW:HIGH tokens") from None
        return cls(*bounds)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int = 200  # turns in all
    rate_per_s: float | None = None
    concurrency: int | None = None
    prompt: LengthDist = LengthDist(128, 128)  # new tokens per turn
    output: LengthDist = LengthDist(64, 64)
    prefix_tokens: int = 0  # a shared prefix before each job's first turn
    num_prefixes: int = 1  # how many different prefixes (tenants), Zipf popular
    zipf_s: float = 1.0
    num_turns: int = 1  # turns per job; > 1 makes sessions
    think_time_s: float = 0.0  # between an answer and the next turn of its job
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.rate_per_s is None) == (self.concurrency is None):
            raise ConfigError("give the load as exactly one of a request rate (--rate) or a "
                              "concurrency (--concurrency)")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ConfigError(f"the request rate must be positive, got {self.rate_per_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"the concurrency must be >= 1, got {self.concurrency}")
        for name in ("num_requests", "num_prefixes", "num_turns"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_tokens < 0 or self.think_time_s < 0 or self.zipf_s < 0:
            raise ConfigError("prefix_tokens, think_time_s and zipf_s must be >= 0")

    @property
    def has_sessions(self) -> bool:
        return self.num_turns > 1

    @property
    def num_jobs(self) -> int:
        return math.ceil(self.num_requests / self.num_turns)

    def describe(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "rate_per_s": self.rate_per_s,
                "concurrency": self.concurrency, "prompt_tokens": [self.prompt.low,
                                                                  self.prompt.high],
                "output_tokens": [self.output.low, self.output.high],
                "prefix_tokens": self.prefix_tokens, "num_prefixes": self.num_prefixes,
                "num_turns": self.num_turns, "think_time_s": self.think_time_s,
                "seed": self.seed}


@dataclass(frozen=True, slots=True)
class Turn:
    user_token_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Job:
    job_id: int
    prefix_token_ids: list[int]
    turns: list[Turn]
    start_s: float = 0.0  # open loop: when it arrives; closed loop: set when it starts
    history: list[int] = field(default_factory=list)  # prompt + answers so far

    @property
    def session_id(self) -> str | None:
        return f"s{self.job_id}" if len(self.turns) > 1 else None


def build_jobs(workload: Workload) -> list[Job]:
    """The jobs of `workload`, the same for every architecture (same seed, same prompts)."""
    rng = random.Random(workload.seed)
    prefixes = [_ids(rng, workload.prefix_tokens) for _ in range(workload.num_prefixes)]
    weights = [1 / (k + 1) ** workload.zipf_s for k in range(workload.num_prefixes)]
    jobs, left, now = [], workload.num_requests, 0.0
    for job_id in range(workload.num_jobs):
        num_turns = min(workload.num_turns, left)
        left -= num_turns
        prefix = rng.choices(prefixes, weights)[0]
        turns = [Turn(_ids(rng, workload.prompt.draw(rng)), workload.output.draw(rng))
                 for _ in range(num_turns)]
        jobs.append(Job(job_id, prefix, turns, start_s=now))
        if workload.rate_per_s is not None:
            now += rng.expovariate(workload.rate_per_s / workload.num_turns)
    return jobs


def poisson_jobs(rate: Callable[[float], float], duration_s: float, *, prompt_tokens: int,
                 output_tokens: int, rng: random.Random) -> list[Job]:
    """Single-turn jobs arriving as a Poisson process whose rate (requests/s) is `rate(t)`,
    held for each second, over `duration_s`. Every job sends the same prompt: only the number
    of its tokens matters to a fleet without prefix routing (the autoscaler's stories)."""
    turn = Turn(_ids(rng, prompt_tokens), output_tokens)
    jobs: list[Job] = []
    for second in range(math.ceil(duration_s)):
        for offset in sorted(rng.random() for _ in range(_poisson(rng, rate(second)))):
            if second + offset < duration_s:
                jobs.append(Job(len(jobs), [], [turn], start_s=second + offset))
    return jobs


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's for small means, a rounded normal for large ones)."""
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


@dataclass(frozen=True, slots=True)
class Slo:
    """TTFT and TPOT bounds at a percentile each (ms)."""

    ttft_ms: float
    tpot_ms: float
    ttft_percentile: float = 90.0
    tpot_percentile: float = 90.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ConfigError("the SLO's TTFT and TPOT bounds must be positive (ms)")
        for p in (self.ttft_percentile, self.tpot_percentile):
            if not 0 < p <= 100:
                raise ConfigError(f"an SLO percentile is in (0, 100], got {p}")


def workload_from_bench_report(path: Path) -> tuple[Workload, dict[str, Any]]:
    """The workload a `strata bench --out` report ran (its `config`), and what it measured."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        c = report["config"]
        kind = c["workload"]
        load: dict[str, Any] = ({"rate_per_s": float(c["request_rate"])}
                                if c.get("request_rate") else
                                {"concurrency": int(c["concurrency"])})
        common = dict(output=LengthDist(int(c["output_len"]), int(c["output_len"])),
                      seed=int(c.get("seed", 0)), **load)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a `strata bench --out` report: {e}") from None
    if kind == "multi-turn":
        words = int(c["input_len"]) + CHAT_TOKENS_PER_TURN
        workload = Workload(num_requests=int(c["num_sessions"]) * int(c["num_turns"]),
                            num_turns=int(c["num_turns"]), prompt=LengthDist(words, words),
                            **common)  # type: ignore[arg-type]
    else:
        prefix = int(c["prefix_len"]) if kind == "shared-prefix" else 0
        workload = Workload(num_requests=int(c["num_requests"]), prefix_tokens=prefix,
                            prompt=LengthDist(int(c["input_len"]), int(c["input_len"])),
                            **common)  # type: ignore[arg-type]
    measured = {k: report[k] for k in ("ttft_ms", "tpot_ms", "output_tokens_per_s",
                                       "requests_per_s") if k in report}
    return workload, measured


__all__ = ["Job", "LengthDist", "Slo", "Turn", "Workload", "build_jobs", "poisson_jobs",
           "workload_from_bench_report"]
