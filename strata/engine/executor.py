"""The boundary between the engine's bookkeeping and the maths that runs the model.

The engine decides which tokens of which requests to compute this step and where their KV lives;
a `ModelExecutor` computes them and samples the next token for requests that reached the end of
their known tokens, or returns the pooled hidden state of a pooling request (an embedding).
`strata.model.executor.TorchExecutor` is the real implementation (for encoders,
`strata.model.bert.EncoderExecutor`). An executor that can overlap batches (pipeline parallel)
also implements `AsyncModelExecutor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NewType, Protocol, runtime_checkable

from strata.engine.request import Logprob, Request, SamplingParams
from strata.types import KVPayload, RequestId


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One request's share of a step.

    `token_ids` are the tokens at positions `start_pos .. start_pos + len(token_ids)`; their KV is
    written into the slots given by `block_ids` (slot = block_ids[pos // block_size] * block_size
    + pos % block_size). Attention reads positions 0 .. start_pos + len(token_ids) through the same
    block table. When `needs_sample` is true the executor samples one token from the last position.
    """

    request_id: RequestId
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    needs_sample: bool
    sampling_params: SamplingParams
    output_token_ids: list[int]  # tokens generated so far (penalties, seeded RNG position)
    prompt_token_ids: list[int]  # the repetition penalty's history (with the outputs)
    eos_token_ids: tuple[int, ...] = ()  # held back, with stop token ids, before min_tokens
    # a pooling request: its whole prompt in this one sequence; the executor returns `Pooled`
    is_pooling: bool = False
    lora_name: str = ""  # the LoRA adapter the request runs with ("": the base model)
    lora_digest: str = ""  # its content digest: the executor holds adapters by it

    @classmethod
    def of(cls, request: Request, start: int, num_new: int,
           block_ids: list[int]) -> ScheduledSequence:
        """`num_new` tokens of `request` from position `start`, its KV in `block_ids`."""
        return cls(request_id=request.request_id,
                   token_ids=request.all_token_ids[start : start + num_new], start_pos=start,
                   block_ids=block_ids, needs_sample=start + num_new == request.num_tokens,
                   sampling_params=request.sampling_params,
                   output_token_ids=request.output_token_ids,
                   prompt_token_ids=request.prompt_token_ids,
                   eos_token_ids=request.eos_token_ids, is_pooling=request.is_pooling,
                   lora_name=request.lora_name, lora_digest=request.lora_digest)


@dataclass(frozen=True, slots=True)
class ModelInput:
    sequences: list[ScheduledSequence]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: Logprob | None = None  # set when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class Pooled:
    """A pooling request's result: the embedding of its whole prompt (pooled, normalized as
    the model prescribes)."""

    embedding: list[float]


ModelOutput = dict[RequestId, SampledToken | Pooled]

BatchHandle = NewType("BatchHandle", int)  # names a submitted batch; chosen by the executor


class ModelExecutor(Protocol):
    """Runs the model over a step's batch and samples next tokens.

    Contract: `allocate_kv_cache(num_blocks, block_size)` is called once before `execute`.
    `execute` returns one `SampledToken` for every sequence with `needs_sample` (a `Pooled` when
    the sequence `is_pooling`), and nothing for the others. It must not keep state about
    requests between steps: sampling with a seed depends only on (seed, number of tokens
    generated so far), so results do not depend on the batch.
    """

    def kv_bytes_per_token(self) -> int: ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def execute(self, model_input: ModelInput) -> ModelOutput: ...


@runtime_checkable
class AsyncModelExecutor(Protocol):
    """A `ModelExecutor` that keeps several batches in flight, so that pipeline stages overlap:
    while the last stage runs batch k, the first runs batch k + 1. The engine uses it when the
    executor has these members; a plain `ModelExecutor` runs one batch at a time.

    Contract:
    - `max_concurrent_batches` (>= 1, fixed once the KV cache is allocated) bounds the batches
      submitted and not yet collected.
    - `submit` returns without waiting for the batch. Batches run in submission order through
      every stage: in each stage, a batch's KV writes and reads come after those of every batch
      submitted before it. (The engine relies on this to send the next chunk of a prompt before
      the previous chunk's batch is back: the chunk reads the KV the previous one wrote.)
    - `collect(handle)` blocks until that batch is done and returns what `execute` would have;
      the engine collects every handle exactly once, oldest first. An error raised by `submit`
      or `collect` is fatal to the engine.
    - The engine guarantees: no sequence is submitted whose tokens depend on a batch in flight
      (a decode waits for the previous sampled token); a block that a batch in flight writes is
      never given to another request before that batch is collected; the lists of a submitted
      `ModelInput` stay unchanged until it is collected. A request aborted or preempted while in
      flight may find the blocks it only reads given away: the engine drops its output.
    - `KVTransfer` calls may come between submissions: `import_blocks` writes only blocks that
      no batch in flight writes, and every batch submitted after it must see the import;
      `export_blocks` reads blocks whose writers have all been collected.
    """

    max_concurrent_batches: int

    def submit(self, model_input: ModelInput) -> BatchHandle: ...

    def collect(self, handle: BatchHandle) -> ModelOutput: ...


@runtime_checkable
class KVTransfer(Protocol):
    """An executor that can move blocks of KV in and out (KV offload). One that cannot (the
    simulator, a timing wrapper) refuses every fetched block: it is recomputed."""

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The KV of each block (all layers) as a self-describing payload, in order."""
        ...

    def import_blocks(self, block_ids: list[int], payloads: list[KVPayload]) -> int:
        """Write `payloads[i]` into block `block_ids[i]`, in order, stopping at the first payload
        it refuses (another model, version, dtype or shape; a bad checksum). Returns how many
        were written."""
        ...


@runtime_checkable
class ExportsInto(Protocol):
    """A `KVTransfer` executor that also writes payloads straight into buffers it is given
    (the slots of a shared-memory pool: one copy, not two)."""

    def export_blocks_into(self, block_ids: list[int], buffers: list[memoryview]) -> list[int]:
        """`export_blocks`, each payload written into its buffer; their lengths."""
        ...


@runtime_checkable
class LoraExecutor(Protocol):
    """An executor that serves LoRA adapters beside the base model, held by content digest
    (`ScheduledSequence.lora_digest` selects one per row). Called by the engine's driver only."""

    def add_lora(self, adapter: Any) -> str:
        """Hold `adapter` (strata.model.lora.LoraAdapter); returns its digest."""
        ...

    def has_lora(self, digest: str) -> bool: ...

    def remove_lora(self, digest: str) -> None:
        """Free the adapter's weights; no sequence may name it any more."""
        ...


class TokenDecoder(Protocol):
    """Turns token ids into text (implemented by the model's tokenizer)."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str: ...
