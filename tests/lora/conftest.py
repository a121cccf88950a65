"""The LoRA tests borrow the gateway's live fleet helpers (a gateway in process on a real
socket), the server's wait and the deploy tests' gateway process; the parallel ones share one
model and its adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
for folder in ("server", "gateway", "deploy"):
    sys.path.insert(0, str(HERE.parent / folder))


@pytest.fixture(scope="session")
def nine_head_loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The nine-head tiny model of the parallel tests (T=2 splits its heads 5 + 4 around a shared
    KV head) and two PEFT adapters of it, "a" (all seven modules, r=4) and "b" (q, v, down;
    r=8, rsLoRA): made once for the files that run adapters over ranks."""
    from lora_fixtures import make_adapter
    from model.parallel.parallel_helpers import make_nine_head_model

    root = tmp_path_factory.mktemp("lora-nine")
    base = make_nine_head_model(root / "base")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {"base": base,
            "a": make_adapter(base, root / "a", seed=1, r=4, alpha=8, targets=every),
            "b": make_adapter(base, root / "b", seed=2, r=8, alpha=4,
                              targets=["q_proj", "v_proj", "down_proj"], use_rslora=True)}
