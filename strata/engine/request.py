"""A request, its sampling parameters and its lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from strata.engine.constraint import TokenConstraint
from strata.engine.timeline import PhaseTimeline
from strata.errors import InvalidRequestError
from strata.types import BlockHash, KVPayload, RequestId

# A temperature below this samples greedily (as vLLM's sampling epsilon): 1 / 1e-5 scales a
# logit of 30 to 3e6, still finite in float32, where 5e-324 made it inf and the draw NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # OpenAI's `seed` is an int64


class RequestStatus(enum.IntEnum):
    """Ordered: every status after RUNNING is finished."""

    WAITING = 0
    PREEMPTED = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. `seed` makes sampling reproducible whatever else is in the batch.
    `logprobs` is the number of top alternatives returned per token (0 = only the chosen one).
    `logit_bias` adds (token id, bias) to the logits; `repetition_penalty` scales the logits of
    every token seen so far (prompt included, as Hugging Face does); `min_tokens` holds back EOS
    and `stop_token_ids` (and stop strings) until that many tokens exist. `constraint` is the
    request's own structured-output state (see `constraint.py`): never shared between requests.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(0.0 <= self.temperature <= 2.0, "temperature",
               f"must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k",
               f"must be >= 0 (0 or -1 disables it), got {self.top_k}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed",
               f"must be a 64-bit signed integer (-2**63 .. 2**63-1), got {self.seed}")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs",
               f"must be >= 0, got {self.logprobs}")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias",
               "values must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or so close to it that logits divided by it overflow float32 (an
        inf, then NaN probabilities): such a draw is the argmax anyway."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def has_processors(self) -> bool:
        """Whether anything changes the logits before the choice (else greedy is an argmax)."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or self.constraint is not None)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {message}", param=param)


@dataclass(slots=True)
class Logprob:
    """The log-probability of the chosen token and of the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a prefill instance computed for this request (prefill/decode hand-off): the first
    token it sampled (with its logprob when asked) and how many prompt tokens its prefix cache
    served. The engine appends this token when the prompt is computed instead of the one it
    samples itself (never re-sampled), and reports `num_cached_tokens` as the request's."""

    token_id: int
    logprob: Logprob | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """One sequence in the engine.

    Counters are stored; everything derivable is a property. `num_computed_tokens` counts tokens
    whose KV is in the cache (prefix hits included); it drops to 0 on preemption by recompute.
    `num_in_flight_tokens` counts tokens in batches submitted to the executor and not yet
    collected: the next batch starts after them (pipeline parallel keeps several in flight).
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0  # higher runs first (strata.types.PriorityClass); FCFS within one
    cache_salt: str = ""
    # leading prompt tokens that are public (a shared system prompt): their full blocks are
    # named without `cache_salt`, in the namespace every tenant shares (kv_cache_manager.py)
    num_public_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first schedule)
    num_preemptions: int = 0
    # aging (strata/engine/priority.py): seconds waited before the current wait, when the
    # current wait began (None: at arrival), and whether it ranks with the top class for good
    waited_s: float = 0.0
    queued_at: float | None = None
    is_aged: bool = False
    stop_reason: str | int | None = None
    output_text: str = ""
    # KV offload. `external_kv`: fetched KV payloads by block hash, used at admission only for
    # the blocks after the local prefix hit whose hash is the request's own (then dropped).
    # `kv_export`: the final output carries the KV of the full blocks from
    # `kv_export_start_block` on (those before it are known to be in the store).
    external_kv: dict[BlockHash, KVPayload] = field(default_factory=dict, repr=False)
    kv_export: bool = False
    kv_export_start_block: int = 0
    # Prefill/decode hand-off. `hold_blocks`: when the request finishes normally its full
    # computed blocks stay referenced (out of the free pool) until `Engine.release_held`.
    # `handoff`: the first token comes from the prefill instance (see `Handoff`).
    hold_blocks: bool = False
    handoff: Handoff | None = None
    # A pooling request (an embedding, encoder models): its whole prompt runs in one step (never
    # chunked: an encoder attends both ways), the executor returns the pooled hidden state and
    # the request finishes with it, generating no token.
    is_pooling: bool = False
    # A LoRA adapter (strata.model.lora): its name reaches the executor per row; its content
    # digest goes into the prefix-cache names of the request's blocks, so KV computed with
    # other weights (the base, another adapter, an older load of the name) is never reused.
    lora_name: str = ""
    lora_digest: str = ""
    # Tracing (strata/engine/timeline.py): when the server traces the request, the engine stamps
    # its phases here; None (the default) costs one check where a phase changes.
    timeline: PhaseTimeline | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    @property
    def pending_handoff(self) -> Handoff | None:
        """The hand-off whose first token is still to be appended."""
        return self.handoff if self.num_output_tokens == 0 else None

    @property
    def num_reported_cached_tokens(self) -> int:
        """`cached_tokens` as a client sees it: with a hand-off, what the prefill instance's
        prefix cache served (tokens pulled from it were computed for this request)."""
        return self.handoff.num_cached_tokens if self.handoff else self.num_cached_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        """Known tokens not yet computed nor in flight: 0 while a batch in flight samples the
        next token, which the next computation needs."""
        return self.num_tokens - self.num_computed_tokens - self.num_in_flight_tokens
