"""The whole stack against the reference: `strata serve` (tokenizer, scheduler, paged KV cache,
model, HTTP server) as a real process on a tiny random Llama that the test writes, driven by the
official `openai` client, answers what HF transformers computes in fp32, greedy.

Several prompts of different lengths are sent at once, so the engine batches them (prefills and
decodes in the same steps); streamed and not; one request holding several prompts; the chat
template. Each answer's tokens (count, text) equal HF's greedy tokens, and each token's logprob
equals HF's log-softmax within float tolerance.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
import transformers
from serve_process import ServeProcess, start_serve
from tiny_models import make_tiny_model_dir

MODEL = "tiny-parity"
MAX_TOKENS = 12
PROMPTS = ("hello", "the weather in the north was cold and wet all week",
           "she sells sea shells by the sea shore, and the shells she sells are surely",
           "in the beginning there was a tiny model with random weights and it spoke")
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Reference:
    """HF's greedy continuation of one prompt."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    margins: list[float]  # top-1 minus top-2 logit at each position


class HFReference:
    """HF transformers on the same directory: its tokenizer and a greedy loop over the full
    forward (no KV cache, no generation config: the plainest reference)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype).eval()

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], num_tokens: int = MAX_TOKENS) -> Reference:
        ids, logprobs, margins = list(prompt_ids), [], []
        for _ in range(num_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            ids.append(token)
        return Reference(list(prompt_ids), ids[len(prompt_ids):], logprobs, margins)

    def of_text(self, prompt: str) -> Reference:
        return self.greedy(self.tokenizer.encode(prompt, add_special_tokens=True))

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [str(self.tokenizer.decode([i], skip_special_tokens=False)) for i in ids]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a wide initializer: the random model's greedy tokens vary (not one token repeated)
    return make_tiny_model_dir(tmp_path_factory.mktemp("parity") / "tiny", seed=3,
                               initializer_range=0.2, torch_dtype="float32")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFReference:
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("parity-serve")
    served = start_serve([str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                          "--device", "cpu", "--threads", "1", "--kv-cache-gb", "0.01",
                          "--block-size", "4", "--log-level", "warning"],
                         cache_dir=root / "cache", log_dir=root, timeout_s=120)
    yield served
    served.stop()


def client_of(server: ServeProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0,
          "extra_body": {"ignore_eos": True}}


def assert_matches(choice: openai.types.CompletionChoice, want: Reference,
                   hf: HFReference) -> None:
    assert choice.finish_reason == "length"
    assert choice.text == hf.text(want.ids)
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == hf.token_texts(want.ids)
    got = choice.logprobs.token_logprobs or []
    assert len(got) == MAX_TOKENS
    assert max(abs(g - w) for g, w in zip(got, want.logprobs, strict=True) if g is not None) \
        < LOGPROB_TOLERANCE, (got, want.logprobs)


def test_concurrent_completions_equal_hf_greedy(server: ServeProcess, hf: HFReference) -> None:
    references = [hf.of_text(p) for p in PROMPTS]
    assert len({len(r.prompt_ids) for r in references}) == len(PROMPTS)  # different lengths
    assert len({tuple(r.ids) for r in references}) == len(PROMPTS)

    async def send_all() -> list[openai.types.Completion]:
        async with client_of(server) as client:
            return list(await asyncio.gather(*(
                client.completions.create(model=MODEL, prompt=p, **GREEDY) for p in PROMPTS)))

    for answer, want in zip(asyncio.run(send_all()), references, strict=True):
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == len(want.prompt_ids)
        assert answer.usage.completion_tokens == MAX_TOKENS
        assert_matches(answer.choices[0], want, hf)


def test_concurrent_streams_equal_hf_greedy(server: ServeProcess, hf: HFReference) -> None:
    references = [hf.of_text(p) for p in PROMPTS]

    async def stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        pieces, reason = [], None
        async for chunk in await client.completions.create(model=MODEL, prompt=prompt,
                                                           stream=True, **GREEDY):
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
        return "".join(pieces), reason

    async def send_all() -> list[tuple[str, str | None]]:
        async with client_of(server) as client:
            return list(await asyncio.gather(*(stream(client, p) for p in PROMPTS)))

    assert asyncio.run(send_all()) == [(hf.text(r.ids), "length") for r in references]


def test_one_request_with_several_prompts_equals_hf_greedy(
        server: ServeProcess, hf: HFReference) -> None:
    prompt_ids = [hf.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS[1:]]

    async def send() -> openai.types.Completion:
        async with client_of(server) as client:
            return await client.completions.create(model=MODEL, prompt=prompt_ids, **GREEDY)

    answer = asyncio.run(send())
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice, ids in zip(answer.choices, prompt_ids, strict=True):
        assert_matches(choice, hf.greedy(ids), hf)


def test_chat_through_the_template_equals_hf_greedy(server: ServeProcess,
                                                    hf: HFReference) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is the weather in the north?"}]
    prompt_ids = hf.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    want = hf.greedy(list(prompt_ids))

    async def send() -> openai.types.chat.ChatCompletion:
        async with client_of(server) as client:
            return await client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0.0, max_tokens=MAX_TOKENS,
                logprobs=True, extra_body={"ignore_eos": True})

    answer = asyncio.run(send())
    assert answer.usage is not None and answer.usage.prompt_tokens == len(want.prompt_ids)
    choice = answer.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("length", hf.text(want.ids))
    assert choice.logprobs is not None and choice.logprobs.content is not None
    got = [t.logprob for t in choice.logprobs.content]
    assert max(abs(g - w) for g, w in zip(got, want.logprobs, strict=True)) < LOGPROB_TOLERANCE
