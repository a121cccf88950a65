"""LoRA adapters through the real engine + TorchExecutor against transformers + PEFT (fp32).

Base, adapter A (all seven target modules, r=4) and adapter B (q, v, down; r=8, rsLoRA) give
HF+PEFT's greedy tokens alone and mixed in one batch; adapters are checked against the base
and refused by name; the prefix cache never shares blocks across adapters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_fakes import run_to_completion
from lora_fixtures import hf_greedy, make_models
from safetensors.torch import load_file, save_file

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelInput, ModelOutput
from strata.engine.request import Request, SamplingParams
from strata.errors import ModelNotFoundError
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.model.lora import LoraError, file_digest, load_adapter
from strata.types import RequestId

N = 8
PROMPTS = [[(7 * i + 3) % 250 for i in range(11)], [(5 * i + 1) % 250 for i in range(6)],
           [(3 * i + 2) % 250 for i in range(17)]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def base(paths: dict[str, Path]) -> LoadedModel:
    return load_model(paths["base"], dtype="float32")


@pytest.fixture(scope="module")
def expected(paths: dict[str, Path]) -> dict[tuple[str, int], list[int]]:
    return {(name, i): hf_greedy(paths["base"], paths.get(name) if name != "base" else None,
                                 p, N)
            for name in ("base", "a", "b") for i, p in enumerate(PROMPTS)}


def make_engine(model: LoadedModel, paths: dict[str, Path],
                max_loras: int | None = None) -> Engine:
    executor = TorchExecutor(model.config, model.weights, dtype="float32")
    for name in ("a", "b"):
        executor.add_lora(load_adapter(name, paths[name], model.config))
    return Engine(executor, CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=True),
                  SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64,
                                  enable_chunked_prefill=True, max_loras=max_loras),
                  model.tokenizer, vocab_size=model.config.vocab_size)


def request(rid: str, prompt: list[int], lora: str, paths: dict[str, Path]) -> Request:
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    digest = file_digest(paths[lora]) if lora else ""
    return Request(RequestId(rid), list(prompt), params, lora_name=lora, lora_digest=digest)


def test_each_adapter_alone_matches_hf_peft(base: LoadedModel, paths: dict[str, Path],
                                            expected: dict[tuple[str, int], list[int]]) -> None:
    assert expected[("a", 0)] != expected[("base", 0)]  # the adapters change the output
    assert expected[("b", 0)] != expected[("base", 0)]
    engine = make_engine(base, paths)
    for name in ("base", "a", "b"):
        for i, p in enumerate(PROMPTS):
            engine.add_request(request(f"{name}{i}", p, "" if name == "base" else name, paths))
            out = run_to_completion(engine)
            assert out[RequestId(f"{name}{i}")] == expected[(name, i)], (name, i)


def test_mixed_batch_matches_hf_peft(base: LoadedModel, paths: dict[str, Path],
                                     expected: dict[tuple[str, int], list[int]]) -> None:
    engine = make_engine(base, paths)
    for key, tokens in run_mixed(engine, paths, ("b", "base", "a")).items():
        assert tokens == expected[key], key


def run_mixed(engine: Engine, paths: dict[str, Path], order: tuple[str, ...]
              ) -> dict[tuple[str, int], list[int]]:
    """Every prompt on every adapter of `order` ("base": none), all in flight at once; the
    tokens of each (adapter, prompt)."""
    keys = []
    for i, p in enumerate(PROMPTS):
        for name in order:
            engine.add_request(request(f"{name}{i}", p, "" if name == "base" else name, paths))
            keys.append((name, i))
    out = run_to_completion(engine)
    return {(name, i): out[RequestId(f"{name}{i}")] for name, i in keys}


@pytest.mark.parametrize("max_loras", [None, 1])
def test_max_loras_bounds_the_adapters_of_a_step(
        base: LoadedModel, paths: dict[str, Path], max_loras: int | None,
        expected: dict[tuple[str, int], list[int]]) -> None:
    engine = make_engine(base, paths, max_loras)
    steps: list[set[str]] = []
    execute = engine.executor.execute

    def spy(model_input: ModelInput) -> ModelOutput:
        steps.append({s.lora_name for s in model_input.sequences if s.lora_name})
        return execute(model_input)

    engine.executor.execute = spy  # type: ignore[method-assign]
    for key, tokens in run_mixed(engine, paths, ("a", "base", "b")).items():
        assert tokens == expected[key], key  # deferred rows still finish, with the right tokens
    most = max(len(s) for s in steps)
    assert most == (2 if max_loras is None else 1)


def test_prefix_cache_is_never_shared_across_adapters(base: LoadedModel,
                                                      paths: dict[str, Path]) -> None:
    engine = make_engine(base, paths)
    prompt = PROMPTS[2]
    cached = {}
    for k, lora in enumerate(["a", "b", "", "a"]):
        req = request(f"r{k}", prompt, lora, paths)
        engine.add_request(req)
        run_to_completion(engine)
        cached[k] = req.num_cached_tokens
    assert cached[0] == cached[1] == cached[2] == 0
    assert cached[3] > 0  # the same adapter again reuses its own blocks


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_by_name(base: LoadedModel, paths: dict[str, Path],
                                          tmp_path: Path) -> None:
    with pytest.raises(LoraError, match="'big'.*rank 4 is over the limit --max-lora-rank 2"):
        load_adapter("big", paths["a"], base.config, max_rank=2)
    bad = _edit_config(paths["a"], tmp_path / "t", target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match=r"'odd'.*target modules \['lm_head'\]"):
        load_adapter("odd", bad, base.config)
    other = _edit_config(paths["a"], tmp_path / "o", base_model_name_or_path="org/other")
    with pytest.raises(LoraError, match="'other'.*trained for 'org/other'"):
        load_adapter("other", other, base.config, base_model="org/base")
    assert load_adapter("other", other, base.config, base_model="/models/org/other").rank == 4
    shaped = _edit_config(paths["a"], tmp_path / "s")
    tensors = load_file(str(shaped / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = tensors[key][:-2].contiguous()
    save_file(tensors, str(shaped / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="'shaped'.*q_proj.lora_B has shape"):
        load_adapter("shaped", shaped, base.config)
    missing = tmp_path / "nothing"
    with pytest.raises(LoraError, match="'gone'.*cannot be read"):
        load_adapter("gone", missing, base.config)


def test_digest_changes_with_the_weights(paths: dict[str, Path], tmp_path: Path) -> None:
    copy = Path(shutil.copytree(paths["a"], tmp_path / "c"))
    assert file_digest(copy) == file_digest(paths["a"])
    tensors = load_file(str(copy / "adapter_model.safetensors"))
    key = next(iter(tensors))
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(copy / "adapter_model.safetensors"))
    assert file_digest(copy) != file_digest(paths["a"])


def test_a_retired_adapter_serves_its_requests_then_is_freed(
        base: LoadedModel, paths: dict[str, Path],
        expected: dict[tuple[str, int], list[int]]) -> None:
    """Engine.add_lora / retire_lora (what POST /v1/load_lora_adapter and unload do): a request
    admitted before the retirement finishes on the adapter's weights; one added after is
    refused by name; the weights leave the executor when the last request ends, and adding
    the same files again serves them again."""
    engine = make_engine(base, paths)
    executor = engine.executor
    assert isinstance(executor, TorchExecutor)
    digest = file_digest(paths["a"])
    engine.add_request(request("before", PROMPTS[0], "a", paths))
    first = [t for o in engine.step() for t in o.new_token_ids]  # admitted, prompt computed
    engine.retire_lora(digest)
    with pytest.raises(ModelNotFoundError, match="`a` does not exist"):
        engine.add_request(request("after", PROMPTS[0], "a", paths))
    assert executor.has_lora(digest)  # still in use
    out = run_to_completion(engine)
    assert first + out[RequestId("before")] == expected[("a", 0)]
    assert not executor.has_lora(digest)  # freed with its last request
    assert engine.add_lora(load_adapter("a", paths["a"], base.config)) == digest
    engine.add_request(request("again", PROMPTS[0], "a", paths))
    assert run_to_completion(engine)[RequestId("again")] == expected[("a", 0)]
