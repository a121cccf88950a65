"""`--weights-dtype`: a GGUF's quantized tensors served as they are, HF weights quantized at load.

Story: the tiny llama is written to GGUF files as llama.cpp's converter would (Q8_0, Q4_0,
Q4_1 linear weights). Loaded with `auto`, its linear weights stay `QuantWeight`s holding the
file's own blocks (Q4: under 0.4x of the bf16 bytes) and the model runs them in the C kernels;
loaded with `bf16`, the same file is dequantized as before. Both models see the same weights, so
their logits must agree to bf16's rounding and their greedy tokens must match from the first.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from model.built_kernels import require_kernels
from model.test_llama_parity import forward_logits, prompts, run_greedy
from tiny_models import make_tiny_model_dir, write_tiny_gguf

from strata.engine.executor import ScheduledSequence
from strata.engine.request import SamplingParams
from strata.errors import ConfigError
from strata.model.executor import TorchExecutor
from strata.model.gemm import PackedWeight
from strata.model.loader import LoadedModel, load_model
from strata.model.quant import QuantWeight
from strata.model.quant_loader import weight_bytes
from strata.types import RequestId

Q = gguf.GGMLQuantizationType
QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
MAX_BYTES = {Q.Q8_0: 0.55, Q.Q4_0: 0.4, Q.Q4_1: 0.4}  # of bf16: 34, 18, 20 bytes per 32 weights


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny", seed=3)


def executor(model: LoadedModel) -> TorchExecutor:
    ex = TorchExecutor(model.config, dict(model.weights), dtype="bfloat16")
    ex.allocate_kv_cache(64, 4)
    return ex


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_a_ggufs_quantized_weights_stay_quantized_and_agree_with_dequantized(
        tiny_dir: Path, tmp_path: Path, qtype: Q) -> None:
    require_kernels()
    path = write_tiny_gguf(tiny_dir, tmp_path / "tiny.gguf", qtype)
    kept = load_model(path, weights_dtype="auto")
    dense = load_model(path, weights_dtype="bf16")
    q = kept.weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(q, QuantWeight) and q.kind == qtype.name.lower()
    assert all(isinstance(w, torch.Tensor) for w in dense.weights.values())
    assert weight_bytes(kept.weights) <= MAX_BYTES[qtype] * weight_bytes(dense.weights)
    fast = executor(kept)
    packed = fast.model.layers[1].gate_up
    assert isinstance(packed, PackedWeight) and packed.kind == qtype.name.lower()  # no copy
    token_lists = prompts(seed=11)
    seqs = [ScheduledSequence(RequestId(f"r{i}"), p, 0, list(range(16 * i, 16 * i + 10)), True,
                              SamplingParams(temperature=0.0), [], p)
            for i, p in enumerate(token_lists)]
    got, want = forward_logits(fast, seqs), forward_logits(executor(dense), seqs)
    spread = float(want.std())
    # equal to the bit where both run on AMX tiles (the tiles decode each block to the very bf16
    # weights the dequantized model holds); within bf16's rounding where the vector kernel runs
    torch.testing.assert_close(got, want, atol=0.1 * spread, rtol=0.0)
    assert run_greedy(fast, token_lists, 8) == run_greedy(executor(dense), token_lists, 8)


@pytest.mark.parametrize("mode", ["q8_0", "q4"])
def test_hf_weights_quantized_at_load(tiny_dir: Path, mode: str) -> None:
    require_kernels()
    model = load_model(tiny_dir, weights_dtype=mode)
    kinds = {w.kind for w in model.weights.values() if isinstance(w, QuantWeight)}
    assert kinds == ({"q8_0"} if mode == "q8_0" else {"q4_1", "q8_0"})  # q4: embedding q8_0
    assert isinstance(model.weights["model.norm.weight"], torch.Tensor)
    first = prompts((17,), seed=5)
    assert len(run_greedy(executor(model), first, 4)[0]) == 4


def test_explicit_modes_refuse_what_they_cannot_serve(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        load_model(tiny_dir, dtype="float32", weights_dtype="q8_0")
    with pytest.raises(ConfigError, match="run on the CPU"):
        load_model(tiny_dir, weights_dtype="q4", device="cuda")
    with pytest.raises(ConfigError, match="must be one of"):
        load_model(tiny_dir, weights_dtype="int3")
    dense = load_model(tiny_dir, dtype="float32", weights_dtype="auto")  # auto falls back
    assert all(isinstance(w, torch.Tensor) for w in dense.weights.values())
