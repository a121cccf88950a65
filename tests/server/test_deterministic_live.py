"""Deterministic serving over HTTP, on quantized weights served as they are and on bf16.

Story: the tiny llama is served by a real `strata serve` process as a Q8_0 GGUF with no flag
(the weights stay quantized, as the default model's do, and that is deterministic by default)
and as an HF directory in bf16 with `--deterministic` (bf16 weights are not, by default). The
product's own check (`strata bench --check-determinism`'s `check_determinism`) sends each prompt
alone, again with its prefix cached and inside a concurrent batch of 20, greedy and seeded, and
finds every answer identical (without the switch, on an AMX CPU, the Q8_0 instance reads 5 / 6
cached and 3-5 / 6 batched greedy); a marked stream cut after any of several tokens and resumed
(POST /v1/strata/resume prefills the prompt and the tokens sent, where the unbroken stream had
decoded them) gives the unbroken stream's very tokens, greedy and seeded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
from model.built_kernels import require_kernels
from required import TOOLS, require
from resume_streams import cut_after_tokens, events_of, frames_of, text_of
from serve_process import ServeProcess, start_serve
from tiny_models import make_tiny_model_dir, write_tiny_gguf

from strata.bench.determinism import DeterminismConfig, check_determinism
from strata.protocol.resume import RESUMABLE_HEADER, RESUME_PATH

pytestmark = pytest.mark.timeout(180)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about the sea"}],
        "max_tokens": 40, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module", params=["Q8_0", "bf16"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServeProcess]:
    """The tiny llama served deterministic: as a Q8_0 GGUF on the defaults (quantized weights
    stay quantized), and as an HF directory in bf16 (the default dtype) on the C kernels with
    the switch."""
    require_kernels()
    root = tmp_path_factory.mktemp("deterministic")
    # head_dim 32: decoded rows attend with keys in the vector lanes, free with AVX512-BF16, so
    # quantized weights are deterministic by default (determinism.deterministic_by_default);
    # without AVX512-BF16 that default is off, and the Q8_0 instance is given the switch
    model: Path = make_tiny_model_dir(root / "tiny", seed=3, hidden_size=128)
    switch = [] if TOOLS["avx512_bf16"].is_present() else ["--deterministic"]
    if request.param == "bf16":
        require("avx512_bf16")  # else bf16 weights run oneDNN, whose kernel choice is its own
        switch = ["--deterministic"]
    else:
        model = write_tiny_gguf(model, root / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    proc = start_serve([str(model), "--served-model-name", "tiny", *switch,
                        "--block-size", "4", "--kv-cache-gb", "0.05", "--max-num-seqs", "32",
                        "--threads", "2", "--log-level", "warning"], cache_dir=root / "cache")
    yield proc
    proc.stop()


def test_the_served_instance_says_it_is_deterministic(served: ServeProcess) -> None:
    cards = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"]
    assert [c["deterministic"] for c in cards] == [True]


def test_the_products_check_finds_every_answer_identical(served: ServeProcess) -> None:
    config = DeterminismConfig(url=served.url, num_prompts=6, prompt_words=20, output_len=16,
                               batch_size=20, show_progress=False, timeout_s=60)
    report = asyncio.run(check_determinism(config))
    assert report["errors"] == []
    cells = {(mode, name): (c["identical"], c["total"])
             for mode, row in report["cells"].items() for name, c in row.items()}
    assert cells and all(got == (6, 6) for got in cells.values()), cells
    assert report["all_identical"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95,
                                                           "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_stream_resumed_after_any_token_is_the_unbroken_stream(
        served: ServeProcess, sampling: dict[str, Any]) -> None:
    body = {**CHAT, **sampling}
    whole = frames_of(httpx.post(f"{served.url}/v1/chat/completions", json=body,
                                 headers={RESUMABLE_HEADER: "1"}, timeout=60).content)
    tokens = [t for f in whole for t in f.token_ids]
    assert len(tokens) == 40
    for num_sent in (1, 5, 11, 17, 26, 35):
        before, sent = cut_after_tokens(whole, num_sent)
        start = before[0].marks[0]
        resume = {"path": "/v1/chat/completions", "request": body, "id": start["id"],
                  "created": start["created"], "version": start["version"],
                  "prompt_token_ids": start["prompt"], "output_token_ids": sent}
        rest = frames_of(httpx.post(f"{served.url}{RESUME_PATH}", json=resume,
                                    timeout=60).content)
        assert [t for f in before + rest for t in f.token_ids] == tokens, num_sent
        assert text_of(events_of(before) + events_of(rest)) == text_of(events_of(whole))
