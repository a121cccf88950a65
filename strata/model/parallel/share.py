"""When a rank cannot run its share of a step: the collectives it still owes, and what it tells
rank 0.

A tensor-parallel step is matched collectives: every rank of the stage sums each layer's
partial results with the others (`all_reduce`) and hands its vocabulary slice of the logits to
the sampling rank (`gather`). A rank whose share raises midway (a kernel that cannot run one
sequence, a sampler that refuses a row) must not leave its peers waiting in a collective it
will never make, nor stay one collective behind them for ever. So it

1. replays the rest of the step: the model's forward over a placeholder batch of the same
   shape (the step's token count and sampled rows; it reads no cache and writes one scratch
   slot), its first calls skipped since they were made before the failure (`CallCount`);
   the collectives of a step depend only on its shape, so the peers see the ones they wait for,
   with garbage in them;
2. reports, as every rank does after every step, whether its share ran: one tiny gather to
   rank 0 (`report_shares`).

Rank 0 then voids the whole step (`ShareFailedError`): every rank wrote garbage into the KV slots
of the step's new tokens, which a step run again over the same sequences rewrites, exactly as
strata/engine/isolation.py reruns a plain executor's batch in halves; the engine drops the
sequence at fault on every rank by leaving it out of the next batches. A rank whose replay fails
too cannot go on: it raises, its process ends, and the instance restarts whole.

`ShareFault` is a test's way to make one rank's share fail (nothing sets it in production).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from strata.engine.executor import ModelInput
from strata.model.attention import PrefillChunk, StepBatch
from strata.model.parallel.comm import Communicator


@dataclass(frozen=True, slots=True)
class ShareFault:
    """Test-only: rank `rank` cannot run its share of a step whose tokens hold `token_id` (or,
    with `prompt_run`, a step of a sequence whose prompt holds that run of token ids: every step
    of one request, decode steps included, and of no other; rank 0 only, the other ranks get a
    step's rows without the prompts). It raises at its `at_call`-th
    collective of the step (1-based; 0: before the forward), as a kernel failing on one sequence
    would; with `is_fatal` its replay fails too."""

    rank: int
    token_id: int = -1
    at_call: int = 0
    is_fatal: bool = False
    prompt_run: tuple[int, ...] = ()

    def is_armed(self, rank: int, model_input: ModelInput) -> bool:
        return rank == self.rank and any(self._holds(s.token_ids, s.prompt_token_ids)
                                         for s in model_input.sequences)

    def _holds(self, token_ids: list[int], prompt_token_ids: list[int]) -> bool:
        if not self.prompt_run:
            return self.token_id in token_ids
        n = len(self.prompt_run)
        run = list(self.prompt_run)
        return any(prompt_token_ids[i : i + n] == run
                   for i in range(len(prompt_token_ids) - n + 1))

    def trip(self, where: str) -> None:
        what = f"the prompt run {list(self.prompt_run)}" if self.prompt_run \
            else f"token {self.token_id}"
        raise RuntimeError(f"injected fault: rank {self.rank} cannot run {what} ({where})")


class CallCount:
    """The collectives of one share of a step: how many were made, and in a replay how many to
    skip (those made before the failure)."""

    def __init__(self) -> None:
        self.num_made = 0
        self.num_calls = 0
        self.num_skipped = 0

    def begin_share(self) -> None:
        self.num_made = self.num_calls = self.num_skipped = 0

    def begin_replay(self) -> None:
        self.num_calls, self.num_skipped = 0, self.num_made

    def skips(self) -> bool:
        """Count a call; True when the replay skips it (it was made before the failure)."""
        self.num_calls += 1
        return self.num_calls <= self.num_skipped


def placeholder_batch(model_input: ModelInput, device: str) -> StepBatch:
    """A batch of `model_input`'s shape (its token count and sampled rows) that reads no cache:
    one prompt chunk from position 0 attending to itself, every token written to slot 0."""
    num_tokens = model_input.num_tokens
    num_sampled = sum(s.needs_sample for s in model_input.sequences)
    return StepBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device),
        positions=torch.arange(num_tokens, device=device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        num_decodes=0,
        decode_block_table=torch.zeros((0, 1), dtype=torch.long, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
        prefills=[PrefillChunk(0, num_tokens, None, None)],
        sample_rows=torch.arange(num_tokens - num_sampled, num_tokens, device=device),
        block_size=1,
    )


def report_shares(group: Communicator, is_failed: bool) -> list[int]:
    """Every rank of `group` says whether its share of the step ran; rank 0 of the group gets
    the ranks whose share failed ([] elsewhere)."""
    status = torch.tensor([[1.0 if is_failed else 0.0]])
    gathered: Tensor | None = group.gather(status, [1] * group.world_size, root=0)
    if gathered is None:
        return []
    return [r for r in range(group.world_size) if gathered[0, r].item() != 0.0]


__all__ = ["CallCount", "ShareFault", "placeholder_batch", "report_shares"]
