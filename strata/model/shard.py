"""Which part of a Llama-family model one process computes, and how it meets the other parts.

A `RankShard` names the query heads, KV heads, MLP rows, vocabulary rows and layers a rank owns;
`RankShard.full(config)` is the whole model (one process, T = P = 1). A rank's model is then just
a smaller model plus a few `ShardComm` hooks: the sums of the row-parallel projections, the
vocab-parallel embedding and LM head, and the hidden states passed between pipeline stages.
`LocalComm` is the hooks of the whole model: all of them do nothing, so one process runs exactly
the code and the speed it ran before tensor parallel existed.

Head groups need not be even: with 9 query heads over 3 KV heads split across 2 ranks, rank 0
computes heads 0-4 and rank 1 heads 5-8; KV head 1 serves heads 3-5, so both ranks hold it
(`kv_heads` of rank 0 is 0-1, of rank 1 is 1-2) and each rank's heads per KV head differ
(3 + 2 and 1 + 3). `head_start` says which local query heads each local KV head serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from strata.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class RankShard:
    """The slices of the model one rank holds, as ranges of global indices."""

    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    layers: range
    num_layers: int  # of the whole model
    group_size: int  # query heads per KV head in the whole model

    @staticmethod
    def full(config: ModelConfig) -> RankShard:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        return RankShard(range(heads), range(kv_heads), range(config.intermediate_size),
                         range(config.vocab_size), range(config.num_hidden_layers),
                         config.num_hidden_layers, heads // kv_heads)

    @property
    def is_first_stage(self) -> bool:
        return self.layers.start == 0

    @property
    def is_last_stage(self) -> bool:
        return self.layers.stop == self.num_layers

    @property
    def head_start(self) -> tuple[int, ...]:
        """Local KV head g serves local query heads head_start[g] .. head_start[g + 1] - 1."""
        starts = [max(g * self.group_size, self.q_heads.start) - self.q_heads.start
                  for g in self.kv_heads]
        return (*starts, len(self.q_heads))

    @property
    def is_uniform(self) -> bool:
        """Every local KV head serves the same number of local query heads."""
        starts = self.head_start
        sizes = {b - a for a, b in zip(starts, starts[1:], strict=False)}
        return len(sizes) == 1

    def is_full(self, config: ModelConfig) -> bool:
        return self == RankShard.full(config)

    def rows(self, head_dim: int) -> tuple[slice, slice, slice]:
        """The rank's rows of a q projection, of a k (or v) projection and of a gate (or up)
        projection: what column-parallel weights keep, and row-parallel ones' columns."""
        return (slice(self.q_heads.start * head_dim, self.q_heads.stop * head_dim),
                slice(self.kv_heads.start * head_dim, self.kv_heads.stop * head_dim),
                slice(self.intermediate.start, self.intermediate.stop))


class ShardComm(Protocol):
    """What a shard of the model needs of its peers (see the module docstring)."""

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over the tensor-parallel group, in place; identical on every rank."""
        ...

    def gather_vocab(self, logits: Tensor) -> Tensor | None:
        """Logits (rows, vocab shard) -> (rows, vocab) on the sampling rank, None elsewhere."""
        ...

    def recv_hidden(self, like: Tensor) -> Tensor:
        """The previous pipeline stage's hidden states, shaped and typed like `like`."""
        ...

    def send_hidden(self, x: Tensor) -> None:
        """Hand this stage's hidden states to the next pipeline stage."""
        ...


class LocalComm:
    """The hooks of the whole model in one process: nothing to sum, gather or pass on."""

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def gather_vocab(self, logits: Tensor) -> Tensor | None:
        return logits

    def recv_hidden(self, like: Tensor) -> Tensor:
        raise RuntimeError("invariant single_stage: the whole model has no previous stage")

    def send_hidden(self, x: Tensor) -> None:
        raise RuntimeError("invariant single_stage: the whole model has no next stage")
