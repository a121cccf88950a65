"""Structured output as the engine sees it: a per-request `TokenConstraint`.

The grammar itself lives outside the engine (`strata.model.structured` builds one from a JSON
schema, a regex or a list of choices). It travels in `SamplingParams.constraint`; the executor
asks it for the allowed next tokens of each sampled row (beside the forward pass) and the
sampler masks the rest; the engine advances it with each token it appends, on the engine thread,
before the request's next token is scheduled (a decode waits for its previous token, so the
state is current whenever a mask is computed, even with batches in flight).

Contract:
- `fill_bitmask(bitmask, row)` writes row `row` of an int32 numpy array (rows, ceil(vocab / 32)):
  bit `t % 32` of word `t // 32` is set iff token `t` may come next. It may run on a worker
  thread while the engine thread waits for the step; it must not change the state.
- `accept(token_id)` advances past a token; False if the grammar refuses it (then the request
  ends with `finish_reason: "error"`).
- `is_terminated` is true once the grammar has accepted a stop token: nothing may follow.
- A request's constraint is its own (never shared by two requests or two choices). Preemption
  by recompute keeps it (the tokens it accepted stay in the request).
- A constraint that crosses a process boundary (pipeline stages pickle the step) must pickle as
  a snapshot of its current mask; the engine's own copy is the one that advances.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenConstraint(Protocol):
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None: ...

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


__all__ = ["TokenConstraint", "bitmask_words"]
