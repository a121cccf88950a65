"""The process-wide switch of `strata serve --deterministic` (issue 31): a request's tokens do not
depend on its batch, its cached prefix or a recomputation of its answer.

Two mechanisms read it, each at the point where it chooses how to compute:
  - the matmuls (gemm.matmul, linear.linear) run one kernel at every row count: the AMX tiles
    where they run, else the vector kernel, bf16 weights never on oneDNN's copy. The kernels
    round a row differently, so picking one by the number of rows would tie a row's result to
    its batch.
  - the decode attention (attention.DecodePlan) computes a decoded row as the chunk kernel
    computes a prefill's, so a resumed stream, a moved session or a preemption that prefills
    decoded tokens again gets their very KV (bf16 KV with head_dim a multiple of 32 does so
    always: it costs nothing there).
Set once per process before its first step; a tensor-parallel rank copies rank 0's (RankSpec).
On by default where a busy instance pays nothing for it (`deterministic_by_default`); the cost
is measured in docs/benchmarks.md ("Determinism").
"""

from __future__ import annotations

from collections.abc import Mapping

from strata.model.quant import QuantWeight

_on = False


def deterministic_by_default(weights: Mapping[str, object], *, free_attention: bool) -> bool:
    """`strata serve`'s default: on when the model's weights are served quantized (a GGUF's
    Q8_0/Q4_0/Q4_1 as loaded, the default model) and its decode attention computes a decoded
    row as a prefill does at no cost (`free_attention`: bf16 KV with keys in the vector lanes,
    `cpu_kernels.decodes_keys_in_lanes`). A batch of 3 rows and more runs the AMX tiles either
    way (the vector kernel everywhere without AMX), so a busy instance runs the same kernels
    with the switch as without; one or two rows pay the tiles' weight decode (one stream
    0.6-0.75x on an AMX CPU). Off for bf16 and float32 weights, since batches above 64 rows run
    faster on oneDNN's matmul, which the switch gives up, and where the attention would cost
    (a CPU without AVX512-BF16, float32 KV: the chunk task with one token, 1.4-2x the plain
    decode kernel's time)."""
    return free_attention and any(isinstance(w, QuantWeight) for w in weights.values())


def set_deterministic(on: bool) -> None:
    """Turn the switch on (or off) for this process."""
    global _on
    _on = on


def is_deterministic() -> bool:
    """Whether `set_deterministic(True)` holds in this process."""
    return _on


__all__ = ["deterministic_by_default", "is_deterministic", "set_deterministic"]
