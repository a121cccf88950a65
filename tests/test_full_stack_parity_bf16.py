"""The whole stack against HF transformers in the default dtype: `strata serve --dtype bfloat16`
(tokenizer, scheduler, paged KV cache, model, HTTP server) on the tiny random Llama of
test_full_stack_parity.py, over HTTP, against HF's bf16 greedy. The streams ask for the resume
marks, which carry the exact token ids (the fp32 test reads texts through the `openai` client).

bf16 sums in a different order give different roundings, so identity is not the claim: each
answer's tokens equal HF's until the two part, logprobs within the bf16 tolerance until then,
and a parting only where HF's own top two logits nearly tied (tests/bf16_rule.py, the margin
rule of the model tests). Concurrent prompts of different lengths (one batch), and the chat
template.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from bf16_rule import Run, assert_bf16_agrees, parting
from resume_streams import events_of, frames_of
from serve_process import ServeProcess, start_serve
from test_full_stack_parity import MAX_TOKENS, MODEL, PROMPTS, HFReference, Reference
from tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("parity-bf16") / "tiny", seed=3,
                               initializer_range=0.2, torch_dtype="float32")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFReference:
    return HFReference(model_dir, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("parity-bf16-serve")
    served = start_serve([str(model_dir), "--served-model-name", MODEL, "--dtype", "bfloat16",
                          "--device", "cpu", "--threads", "1", "--kv-cache-gb", "0.01",
                          "--block-size", "4", "--log-level", "warning"],
                         cache_dir=root / "cache", log_dir=root, timeout_s=120)
    yield served
    served.stop()


def reference_run(want: Reference) -> Run:
    return Run(list(want.ids), want.logprobs, want.margins)


async def served(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Served:
    """One greedy stream with the resume marks asked for (`X-Strata-Resumable`): they carry
    the exact prompt and token ids (a byte token's text, often "\ufffd", names no id)."""
    body = {**body, "stream": True, "temperature": 0.0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    response = await client.post(path, json=body, headers={"X-Strata-Resumable": "1"})
    assert response.status_code == 200, response.text
    frames = frames_of(response.content)
    prompt = next(m["prompt"] for f in frames for m in f.marks if "prompt" in m)
    logprobs = [float(entry) for e in events_of(frames) for c in e["choices"]
                for entry in logprob_values(c)]
    tokens = [t for f in frames for t in f.token_ids]
    assert len(tokens) == len(logprobs) == MAX_TOKENS
    return Served(list(prompt), Run(list(tokens), logprobs, []))


def logprob_values(choice: dict[str, Any]) -> list[float]:
    found = choice.get("logprobs") or {}
    if "content" in found:  # chat
        return [t["logprob"] for t in found["content"] or []]
    return list(found.get("token_logprobs") or [])  # completions


@dataclass(frozen=True)
class Served:
    prompt_ids: list[int]
    run: Run


def test_concurrent_completions_in_bf16_part_from_hf_only_at_near_ties(
        server: ServeProcess, hf: HFReference) -> None:
    references = [hf.of_text(p) for p in PROMPTS]

    async def send_all() -> list[Served]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return list(await asyncio.gather(*(
                served(client, "/v1/completions", {"model": MODEL, "prompt": p, "logprobs": 0})
                for p in PROMPTS)))

    same = 0
    for prompt, got, want in zip(PROMPTS, asyncio.run(send_all()), references, strict=True):
        assert got.prompt_ids == want.prompt_ids
        assert_bf16_agrees(reference_run(want), got.run, repr(prompt))
        same += parting(reference_run(want), got.run) is None
    print(f"bf16 full stack vs HF bf16: {same}/{len(PROMPTS)} identical over {MAX_TOKENS}")
    assert same >= len(PROMPTS) // 2


def test_chat_in_bf16_parts_from_hf_only_at_a_near_tie(server: ServeProcess,
                                                       hf: HFReference) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is the weather in the north?"}]
    prompt_ids = hf.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    want = hf.greedy(list(prompt_ids))

    async def send() -> Served:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await served(client, "/v1/chat/completions",
                                {"model": MODEL, "messages": messages, "logprobs": True})

    got = asyncio.run(send())
    assert got.prompt_ids == want.prompt_ids  # the chat template rendered as HF renders it
    assert_bf16_agrees(reference_run(want), got.run, "chat")
