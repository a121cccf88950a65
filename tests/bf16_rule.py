"""The rule by which a bf16 run is held to a reference: greedy tokens identical until the two
part, and they may part only where the reference itself nearly tied.

bf16 keeps 8 mantissa bits: on the tiny test models (logits spread about 1.6) a bf16 logit lands
within `BF16_LOGIT_TOLERANCE` (0.3) of the exact one (tests/model/test_llama_parity.py measures
it). Two bf16 runs that order their sums differently may then disagree on the argmax only where
the reference's top two logits are closer than twice that: `NEAR_TIE` (0.6), the margin rule of
the model tests. Before they part, each token's logprob agrees within the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_LOGIT_TOLERANCE = 0.3
NEAR_TIE = 2 * BF16_LOGIT_TOLERANCE


@dataclass(frozen=True)
class Run:
    """One greedy continuation: its tokens (ids, or their texts where a server returns only
    texts), each token's logprob, and the reference's margin (top-1 minus top-2 logit) at each
    position, where known."""

    tokens: list[object]
    logprobs: list[float]
    margins: list[float]


def parting(reference: Run, got: Run) -> int | None:
    """The first position where `got` leaves `reference`, or None."""
    return next((i for i, (a, b) in enumerate(zip(reference.tokens, got.tokens, strict=True))
                 if a != b), None)


def assert_bf16_agrees(reference: Run, got: Run, what: str = "") -> None:
    """Identical until they part, logprobs within the tolerance until then, and a parting only
    at a near tie of the reference."""
    part = parting(reference, got)
    until = len(reference.tokens) if part is None else part
    for i in range(until):
        assert abs(reference.logprobs[i] - got.logprobs[i]) < BF16_LOGIT_TOLERANCE, \
            f"{what}: token {i} logprob {got.logprobs[i]} vs {reference.logprobs[i]}"
    if part is not None:
        assert reference.margins[part] < NEAR_TIE, \
            f"{what}: parts at token {part} ({got.tokens[part]!r} for " \
            f"{reference.tokens[part]!r}), where the reference's margin is " \
            f"{reference.margins[part]:.3f} (a near tie is < {NEAR_TIE})"


__all__ = ["BF16_LOGIT_TOLERANCE", "NEAR_TIE", "Run", "assert_bf16_agrees", "parting"]
