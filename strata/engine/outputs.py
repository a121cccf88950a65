"""What the engine hands back after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.engine.request import FinishReason, Logprob
from strata.types import BlockHash, RequestId


@dataclass(frozen=True, slots=True)
class HeldBlocks:
    """The blocks a finished request left held (`Request.hold_blocks`): those of its computed
    tokens, the partial last one included, in order, with their chain hashes; they stay out of
    the free pool until `Engine.release_held(request_id)`."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[BlockHash, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True)
class RequestOutput:
    """The news of one request after one step.

    `new_text` is the text that became final this step: it never contains a stop string and never
    ends inside a multi-byte character or a possible stop-string prefix (held back until decided).
    """

    request_id: RequestId
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # with `Request.kv_export`, on the final output: (block hash, KV payload) to publish
    kv_blocks: list[tuple[BlockHash, bytes]] = field(default_factory=list, repr=False)
    # with `Request.hold_blocks`, on the final output of a normal finish: the blocks held
    held: HeldBlocks | None = None
    # a pooling request's only output: its embedding (`Request.is_pooling`)
    embedding: list[float] | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics and the gateway's load reports."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of blocks in use by running requests
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which served from the cache
    num_preemptions: int
    num_prompt_tokens: int  # computed prompt tokens, cumulative (cache hits excluded)
    num_generated_tokens: int  # cumulative
    num_external_hit_tokens: int = 0  # prompt tokens imported from fetched KV, cumulative
    num_kv_import_failures: int = 0  # fetched payloads the executor refused (recomputed)
    num_batches_in_flight: int = 0  # submitted to the executor, not yet collected
    num_priority_preemptions: int = 0  # of num_preemptions: room made for a higher priority
    num_held_blocks: int = 0  # held for finished requests (`Request.hold_blocks`)

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
