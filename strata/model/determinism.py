"""The process-wide switch of `strata serve --deterministic` (issue 31): a request's tokens do not
depend on its batch, its cached prefix or a recomputation of its answer.

Two mechanisms read it, each at the point where it chooses how to compute:
  - the matmuls (gemm.matmul, linear.linear) run one kernel at every row count: the AMX tiles
    where they run, else the vector kernel, bf16 weights never on oneDNN's copy. The kernels
    round a row differently, so picking one by the number of rows would tie a row's result to
    its batch.
  - the decode attention (attention.DecodePlan) computes a decoded row as the chunk kernel
    computes a prefill's, so a resumed stream, a moved session or a preemption that prefills
    decoded tokens again gets their very KV.
Set once per process before its first step; a tensor-parallel rank copies rank 0's (RankSpec).
The cost is measured in docs/benchmarks.md ("Determinism").
"""

from __future__ import annotations

_on = False


def set_deterministic(on: bool) -> None:
    """Turn the switch on (or off) for this process."""
    global _on
    _on = on


def is_deterministic() -> bool:
    """Whether `set_deterministic(True)` holds in this process."""
    return _on


__all__ = ["is_deterministic", "set_deterministic"]
