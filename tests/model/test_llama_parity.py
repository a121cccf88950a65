"""Strata's Llama-family forward against HF transformers on tiny random models.

Story: three prompts of 3, 17 and 40 tokens share one paged KV cache whose blocks are handed out
in a scattered order; the third prompt joins one step late, so its prefill runs in the same step
as the others' decodes. After 32 greedy steps every sequence must equal HF's greedy tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
from model.built_kernels import require_kernels
from torch import Tensor
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from strata.engine.executor import ModelInput, SampledToken, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.model import cpu_kernels
from strata.model.executor import TorchExecutor, build_step_batch
from strata.model.hf_config import model_config_from_hf
from strata.types import RequestId

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            initializer_range=0.2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 10000.0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPT_LENGTHS = (3, 17, 40)
NUM_NEW_TOKENS = 32


def tiny_hf_model(kind: str) -> PreTrainedModel:
    """A seeded random model; norms and biases are perturbed so that they matter."""
    torch.manual_seed(1234)
    if kind == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**TINY))
    elif kind == "llama_tied_rope3":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True,
                                             rope_parameters=LLAMA3_ROPE))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    else:
        model = MistralForCausalLM(MistralConfig(**TINY))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    return model.eval()


def make_executor(hf: PreTrainedModel, *, dtype: str = "float32", device: str = "cpu",
                  num_blocks: int = 64, block_size: int = 4) -> TorchExecutor:
    config = model_config_from_hf(hf.config.to_dict())
    executor = TorchExecutor(config, hf.state_dict(), dtype=dtype, device=device)
    executor.allocate_kv_cache(num_blocks, block_size)
    return executor


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Seq:
    """The test's stand-in for the engine's bookkeeping of one request."""

    request_id: RequestId
    prompt: list[int]
    blocks: list[int] = field(default_factory=list)
    params: SamplingParams = GREEDY
    output: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit, if logprobs
    num_computed: int = 0

    def schedule(self, free: deque[int], block_size: int) -> ScheduledSequence:
        tokens = (self.prompt + self.output)[self.num_computed:]
        while len(self.blocks) * block_size < self.num_computed + len(tokens):
            self.blocks.append(free.popleft())
        return ScheduledSequence(self.request_id, tokens, self.num_computed, list(self.blocks),
                                 True, self.params, list(self.output), self.prompt)

    def record(self, sampled: SampledToken) -> None:
        self.output.append(sampled.token_id)
        if sampled.logprob is not None:
            (_, first), (_, second) = sampled.logprob.top[:2]
            self.margins.append(first - second)


def run_greedy(executor: TorchExecutor, token_lists: list[list[int]],
               num_new: int = NUM_NEW_TOKENS) -> list[list[int]]:
    """Generate with the last prompt joining one step late; blocks handed out scattered."""
    return [s.output for s in run_seqs(executor, token_lists, num_new, GREEDY)]


def run_seqs(executor: TorchExecutor, token_lists: list[list[int]], num_new: int,
             params: SamplingParams) -> list[Seq]:
    kv = executor.kv_cache
    assert kv is not None
    order = torch.randperm(kv.num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    free = deque(order)
    seqs = [Seq(RequestId(f"r{i}"), p, params=params) for i, p in enumerate(token_lists)]
    step = 0
    while any(len(s.output) < num_new for s in seqs):
        active = [s for i, s in enumerate(seqs)
                  if len(s.output) < num_new and (step > 0 or i < len(seqs) - 1)]
        scheduled = [s.schedule(free, kv.block_size) for s in active]
        out = executor.execute(ModelInput(scheduled, kv.block_size))
        assert sorted(out) == sorted(s.request_id for s in active)
        for s, sched in zip(active, scheduled, strict=True):
            s.num_computed += len(sched.token_ids)
            s.record(out[s.request_id])
        step += 1
    return seqs


def hf_greedy(hf: PreTrainedModel, prompt: list[int], num_new: int = NUM_NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def forward_logits(executor: TorchExecutor, seqs: list[ScheduledSequence],
                   chunk_kernel: bool = False) -> Tensor:
    """Logits of the sampled rows, through the same batch builder that `execute` uses.

    Without `chunk_kernel` every prefill chunk runs on the torch paths (SDPA, matmuls)."""
    kv = executor.kv_cache
    assert kv is not None
    with torch.inference_mode():
        batch = build_step_batch(seqs, kv.block_size, kv.null_slot, executor.device,
                                 chunk_kernel=chunk_kernel)
        return executor.model.forward(batch, kv).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "block_size"), [
    ("llama", 4), ("llama", 16), ("llama_tied_rope3", 4), ("qwen2", 16), ("mistral", 4),
])
def test_greedy_tokens_match_hf(kind: str, block_size: int, device: str) -> None:
    hf = tiny_hf_model(kind)
    executor = make_executor(hf, device=device, block_size=block_size,
                             num_blocks=256 // block_size)
    token_lists = prompts()
    expected = [hf_greedy(hf, p) for p in token_lists]
    assert run_greedy(executor, token_lists) == expected


def test_configs_exercise_their_features() -> None:
    tied = model_config_from_hf(tiny_hf_model("llama_tied_rope3").config.to_dict())
    qwen = model_config_from_hf(tiny_hf_model("qwen2").config.to_dict())
    assert tied.tie_word_embeddings and tied.rope_scaling is not None
    assert tied.rope_scaling.original_max_position_embeddings == 16
    assert qwen.attention_bias


@pytest.mark.parametrize("chunk_kernel", [False, True], ids=["torch-paths", "chunk-kernel"])
def test_chunked_prefill_equals_one_shot(chunk_kernel: bool) -> None:
    """Chunks over a cached context (kernel or torch matmuls) against one torch SDPA prefill."""
    if chunk_kernel:
        require_kernels()
        assert cpu_kernels.supports_chunk(torch.float32, "cpu", 16)
    hf = tiny_hf_model("llama")
    prompt = prompts((40,))[0]
    params = GREEDY
    one_shot = make_executor(hf)
    whole = ScheduledSequence(RequestId("a"), prompt, 0, list(range(10)), True, params, [], prompt)
    expected = forward_logits(one_shot, [whole])

    chunked = make_executor(hf)
    blocks = [17, 3, 40, 8, 29, 11, 60, 0, 33, 21]
    bounds = [(0, 13), (13, 27), (27, 40)]
    logits = torch.empty(0)
    for lo, hi in bounds:
        seq = ScheduledSequence(RequestId("a"), prompt[lo:hi], lo, blocks, hi == 40, params, [],
                                prompt)
        logits = forward_logits(chunked, [seq], chunk_kernel)
    assert logits.shape == (1, 256)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert int(logits.argmax()) == hf_greedy(hf, prompt, 1)[0]


def test_bf16_logits_close_to_fp32_and_greedy_agrees_early() -> None:
    hf = tiny_hf_model("llama")
    token_lists = prompts()
    seqs = [ScheduledSequence(RequestId(f"r{i}"), p, 0, list(range(16 * i, 16 * i + 10)), True,
                              GREEDY, [], p) for i, p in enumerate(token_lists)]
    fp32 = forward_logits(make_executor(hf), seqs)
    bf16 = forward_logits(make_executor(hf, dtype="bfloat16"), seqs)
    assert bf16.dtype == torch.float32  # logits are returned in float32 whatever the weights
    # bf16 keeps 8 mantissa bits; on this model (logits spread about 1.6) both Strata's and HF's
    # bf16 logits land within 0.25 of fp32, so the tolerance is 0.3 absolute.
    torch.testing.assert_close(bf16, fp32, atol=0.3, rtol=0.0)
    with_margins = SamplingParams(temperature=0.0, logprobs=2)
    reference = run_seqs(make_executor(hf), token_lists, 8, with_margins)
    low_precision = run_greedy(make_executor(hf, dtype="bfloat16"), token_lists, num_new=8)
    for ref, got in zip(reference, low_precision, strict=True):
        assert got[0] == ref.output[0]
        first_diff = next((i for i, (a, b) in enumerate(zip(ref.output, got, strict=True))
                           if a != b), None)
        # Greedy may only part ways where fp32 itself nearly tied (margin under 2 x tolerance).
        assert first_diff is None or ref.margins[first_diff] < 0.6
