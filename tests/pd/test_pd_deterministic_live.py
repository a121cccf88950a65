"""The prefill/decode hand-off in the serving dtype, not only float32: with the process
deterministic (issue 31; the default for quantized weights), what D answers after pulling P's
bf16 KV, while it decodes other requests beside it, is token for token what one mixed instance
answers alone, greedy and seeded, with bf16 weights on the C kernels and with Q8_0 weights kept
quantized. D's batch differs from the mixed instance's, and P prefilled the prompt in one chunk
where D's decode rows attend to it: both would show in the tokens if a row's arithmetic
depended on its company."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import pytest
from model.built_kernels import require_kernels
from pd_fleet import Instance, comparable, decode, mixed, prefill, start_instance
from required import require
from test_pd_live import LONG, body_of
from tiny_models import write_tiny_gguf

from strata.model.determinism import set_deterministic
from strata.model.gemm import PackedWeight
from strata.model.loader import load_model

SAMPLING = [{"temperature": 0}, {"temperature": 0.9, "seed": 11, "top_p": 0.95}]


@pytest.fixture(scope="module", params=["bf16", "Q8_0"])
def trio(request: pytest.FixtureRequest, tiny_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Instance]]:
    require_kernels()
    if request.param == "bf16":
        require("avx512_bf16")  # else bf16 weights run oneDNN, whose kernel choice is its own
        model = load_model(tiny_dir, dtype="bfloat16")
    else:
        path = write_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("pd-q8") / "tiny.gguf",
                               gguf.GGMLQuantizationType.Q8_0)
        model = load_model(path, dtype="bfloat16", weights_dtype="auto")
    set_deterministic(True)
    fleet = {role: start_instance(model, dtype="bfloat16") for role in ("p", "d", "m")}
    try:
        layer = fleet["d"].engine.executor.model.layers[0]  # type: ignore[attr-defined]
        assert isinstance(layer.gate_up, PackedWeight)  # the C kernels run
        yield fleet
    finally:
        set_deterministic(False)
        for instance in fleet.values():
            instance.stop()


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_a_handed_off_request_decoded_in_company_answers_as_one_served_alone(
        trio: dict[str, Instance], sampling: dict[str, Any]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = {**body_of(LONG, n=len(sampling), **sampling), "max_tokens": 24}
    expected = mixed(m, body).json()
    company = [{**body_of(LONG[: 20 + 9 * i], n=100 + i, temperature=0), "max_tokens": 40}
               for i in range(3)]
    pulled = d.metric("pd_handoffs_total", side="decode", outcome="pulled")
    handle = prefill(p, body)
    with ThreadPoolExecutor(len(company) + 1) as pool:
        beside = [pool.submit(mixed, d, other) for other in company]
        answer = pool.submit(decode, d, body, handle).result()
        assert all(other.result().status_code == 200 for other in beside)
    assert answer.status_code == 200, answer.text
    assert comparable(answer.json()) == comparable(expected)
    assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") >= 1
    assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") == pulled + 1
