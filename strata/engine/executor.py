"""The boundary between the engine's bookkeeping and the maths that runs the model.

The engine decides which tokens of which requests to compute this step and where their KV lives;
a `ModelExecutor` computes them and samples the next token for requests that reached the end of
their known tokens. `strata.model.executor.TorchExecutor` is the real implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from strata.engine.request import Logprob, SamplingParams
from strata.types import RequestId


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
    prompt_token_ids: list[int]  # for presence penalties that OpenAI applies to outputs only


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


ModelOutput = dict[RequestId, SampledToken]


class ModelExecutor(Protocol):
    """Runs the model over a step's batch and samples next tokens.

    Contract: `allocate_kv_cache(num_blocks, block_size)` is called once before `execute`.
    `execute` returns one `SampledToken` for every sequence with `needs_sample`, and nothing for the
    others. It must not keep state about requests between steps: sampling with a seed depends only
    on (seed, number of tokens generated so far), so results do not depend on the batch.
    """

    def kv_bytes_per_token(self) -> int: ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def execute(self, model_input: ModelInput) -> ModelOutput: ...


@runtime_checkable
class KVTransfer(Protocol):
    """An executor that can move blocks of KV in and out (KV offload). One that cannot (the
    simulator, a timing wrapper) refuses every fetched block: it is recomputed."""

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The KV of each block (all layers) as a self-describing payload, in order."""
        ...

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> int:
        """Write `payloads[i]` into block `block_ids[i]`, in order, stopping at the first payload
        it refuses (another model, version, dtype or shape; a bad checksum). Returns how many
        were written."""
        ...


class TokenDecoder(Protocol):
    """Turns token ids into text (implemented by the model's tokenizer)."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str: ...
