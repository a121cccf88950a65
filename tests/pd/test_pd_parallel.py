"""The hand-off between instances of different parallel layouts: blocks travel in the whole
model's layout, so a T=2 or P=2 prefill instance feeds a T=1 decode instance and the other way
round. The nine-head model (T=2 splits its 3 KV heads 2 + 2 around a shared head), float32:
every answer is token for token a single mixed T=1 instance's, and the decode side computes
none of the prompt."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import wait_until
from model.parallel.parallel_helpers import make_nine_head_model
from pd_fleet import FLEET, MODEL, Instance, comparable, decode, mixed, prefill, start_instance

from strata.model.loader import load_model
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import prepare_model
from strata.model.parallel.shm import SHM_DIR
from strata.protocol.pd import LAYOUT_PATH

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")

TEXT = ("the river ran high all spring and the mill turned day and night while the town slept, "
        "the miller counting sacks of flour by the light of one lamp")


@pytest.fixture(scope="module")
def nine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nine_head_model(tmp_path_factory.mktemp("pd-parallel") / "nine")


@pytest.fixture(scope="module")
def fleet(nine: Path) -> Iterator[dict[str, Instance]]:
    """m: the mixed T=1 reference; t1: a T=1 peer; t2 and p2: parallel peers (one rank process
    each beside this one)."""
    loaded = load_model(nine, dtype="float32")
    prepared = prepare_model(nine, dtype="float32", cache_dir=None)
    executors = {name: ParallelExecutor(prepared, layout, dtype="float32", model_name=MODEL,
                                        model_version="v1", timeout_s=60)
                 for name, layout in (("t2", ParallelLayout(tensor_size=2)),
                                      ("p2", ParallelLayout(pipeline_size=2)))}
    instances = {"m": start_instance(loaded), "t1": start_instance(loaded),
                 **{name: start_instance(loaded, executor=e) for name, e in executors.items()}}
    yield instances
    for instance in instances.values():
        instance.stop()
    for executor in executors.values():
        executor.shutdown()


def body_of(n: int) -> dict[str, Any]:
    """A prompt no instance has seen (so nothing is cached anywhere), greedy."""
    unique = hashlib.blake2b(str(n).encode(), digest_size=8).hexdigest()
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{unique} {TEXT}"}],
            "max_tokens": 12, "ignore_eos": True, "temperature": 0}


PAIRS = [("t2", "t1"), ("t1", "t2"), ("p2", "t1"), ("t1", "p2"), ("t2", "p2")]


@pytest.mark.parametrize(("p_name", "d_name"), PAIRS, ids=[f"{p}-to-{d}" for p, d in PAIRS])
def test_a_hand_off_across_layouts_answers_as_one_mixed_t1_instance(
        fleet: dict[str, Instance], p_name: str, d_name: str) -> None:
    p, d, m = fleet[p_name], fleet[d_name], fleet["m"]
    body = body_of(PAIRS.index((p_name, d_name)))
    expected = mixed(m, body).json()
    pulled = d.metric("pd_handoffs_total", side="decode", outcome="pulled")
    prompt_tokens = d.engine.stats().num_prompt_tokens
    answer = decode(d, body, prefill(p, body))
    assert answer.status_code == 200, answer.text
    assert comparable(answer.json()) == comparable(expected)
    assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") == pulled + 1
    assert d.engine.stats().num_prompt_tokens == prompt_tokens  # every block came from P
    assert wait_until(lambda: p.num_held_blocks == 0)


def test_the_handshake_shows_the_split_and_compares_the_whole_layout(
        fleet: dict[str, Instance]) -> None:
    layouts = {name: httpx.get(i.url + LAYOUT_PATH, headers=FLEET).json()
               for name, i in fleet.items()}
    assert layouts["t2"]["parallel"] == {
        "name": "tp2", "tensor_size": 2, "pipeline_size": 1,
        "kv_heads_per_rank": [[0, 2], [1, 3]], "layers_per_stage": [[0, 2]]}
    assert layouts["p2"]["parallel"] == {
        "name": "pp2", "tensor_size": 1, "pipeline_size": 2,
        "kv_heads_per_rank": [[0, 3]], "layers_per_stage": [[0, 1], [1, 2]]}
    whole = {"num_layers": 2, "num_kv_heads": 3, "head_dim": 16, "dtype": "float32"}
    for layout in layouts.values():  # every instance's blocks are the whole model's
        assert {k: layout[k] for k in whole} == whole
