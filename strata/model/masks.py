"""Structured-output masks computed beside the forward pass.

`MaskWorker.start` hands the step's constrained rows to one worker thread before the forward
runs; the thread asks each row's `TokenConstraint` for its bitmask (llguidance, which drops the
GIL) and unpacks the inverted bits into a bool (rows, vocab) tensor of disallowed tokens with
numpy, while the engine thread runs the model (torch's kernels release the GIL too).
`PendingMasks.wait` joins it after the forward; the sampler masks the logits in place, one pass.
A step without constraints costs nothing.

The worker only reads the constraints: the engine advances them after the step is back, and
never schedules a request's next token while a step that samples it is in flight.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from strata.engine.constraint import TokenConstraint, bitmask_words
from strata.engine.executor import ScheduledSequence
from strata.model.logits import TokenMask


@dataclass(slots=True)
class PendingMasks:
    rows: list[int]  # positions among the sampled sequences
    num_sampled: int
    future: Future[torch.Tensor]

    def wait(self, device: str) -> TokenMask:
        disallowed = self.future.result().to(device, non_blocking=True)
        if len(self.rows) == self.num_sampled:
            return TokenMask(disallowed)
        return TokenMask(disallowed, torch.tensor(self.rows, dtype=torch.long, device=device))


class MaskWorker:
    """One thread that fills the masks of a step while the model runs."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started on the first constrained step

    def start(self, sampled: list[ScheduledSequence]) -> PendingMasks | None:
        rows = [i for i, s in enumerate(sampled) if s.sampling_params.constraint is not None]
        if not rows:
            return None
        constraints = [sampled[i].sampling_params.constraint for i in rows]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-masks")
        future = self._pool.submit(disallowed_tokens, constraints,  # type: ignore[arg-type]
                                   self.vocab_size)
        return PendingMasks(rows, len(sampled), future)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def bitmasks(constraints: list[TokenConstraint], vocab_size: int) -> np.ndarray:
    bitmask = np.zeros((len(constraints), bitmask_words(vocab_size)), dtype=np.int32)
    for row, constraint in enumerate(constraints):
        constraint.fill_bitmask(bitmask, row)
    return bitmask


def disallowed_tokens(constraints: list[TokenConstraint], vocab_size: int) -> torch.Tensor:
    """bool (len(constraints), vocab_size): token t of row r may not come next."""
    inverted = np.invert(bitmasks(constraints, vocab_size).view(np.uint8))
    bits = np.unpackbits(inverted, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.bool_))


def allowed_tokens(constraints: list[TokenConstraint], vocab_size: int) -> torch.Tensor:
    """bool (len(constraints), vocab_size): token t of row r is allowed next (tests, tools)."""
    return ~disallowed_tokens(constraints, vocab_size)


__all__ = ["MaskWorker", "PendingMasks", "allowed_tokens", "bitmasks", "disallowed_tokens"]
