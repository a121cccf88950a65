"""The BERT sentence encoder against HF transformers on a tiny random `BertModel`: its WordPiece
tokenizer against `BertTokenizerFast`, its pooled embeddings against HF's last hidden state
mean-pooled and normalized (padded batches of different lengths), and the config it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_bert import HIDDEN, MAX_POSITIONS, hf_embeddings, make_tiny_bert_dir

from strata.engine.executor import ModelInput, Pooled, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.errors import ModelLoadError
from strata.model.bert import (
    BertEncoder,
    EncoderExecutor,
    encoder_config,
    encoder_tokenizer,
    is_encoder_dir,
    load_encoder_weights,
)
from strata.types import RequestId

TEXTS = ["hello world", "The quick fox!", "Café crème brûlée, naïve résumé.", "中文 and 日本",
         "embedding tokenizer's tokens: 1, 2, 3... (42%)", "  spaces\tand\nnewlines  ",
         "UNKNOWN words like zyzzyva & émigré?", "a", "ÀÉÎÕÜ ñ ç ß", "hello-world_foo@bar.com"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert_dir(tmp_path_factory.mktemp("bert") / "tiny-bert")


@pytest.fixture(scope="module")
def encoder(bert_dir: Path) -> BertEncoder:
    return BertEncoder(encoder_config(bert_dir), load_encoder_weights(bert_dir, torch.float32))


def test_the_tokenizer_matches_bert_tokenizer_fast(bert_dir: Path) -> None:
    ours = encoder_tokenizer(bert_dir)
    hf = transformers.BertTokenizerFast.from_pretrained(bert_dir)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
    assert ours.encode("hello", add_special_tokens=True)[0] == hf.cls_token_id
    # never truncated: a long input keeps every token (the server refuses it instead)
    long_text = "hello " * (MAX_POSITIONS * 2)
    assert len(ours.encode(long_text, add_special_tokens=True)) == MAX_POSITIONS * 2 + 2


def test_pooled_embeddings_match_hf_in_one_padded_batch(bert_dir: Path,
                                                        encoder: BertEncoder) -> None:
    tokenizer = encoder_tokenizer(bert_dir)
    ours = torch.tensor(encoder.embed([tokenizer.encode(t, add_special_tokens=True)
                                       for t in TEXTS]))
    reference = hf_embeddings(bert_dir, TEXTS)
    assert ours.shape == (len(TEXTS), HIDDEN)
    assert float((ours - reference).abs().max()) < 1e-5
    assert float(torch.cosine_similarity(ours, reference).min()) > 0.99999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert float(torch.cosine_similarity(ours[0], ours[1], dim=0)) < 0.99  # inputs differ


def test_padding_does_not_change_an_embedding(bert_dir: Path, encoder: BertEncoder) -> None:
    tokenizer = encoder_tokenizer(bert_dir)
    short, long = (tokenizer.encode(t, add_special_tokens=True) for t in ("a", TEXTS[4]))
    alone, = encoder.embed([short])
    batched = encoder.embed([long, short])[1]
    assert max(abs(a - b) for a, b in zip(alone, batched, strict=True)) < 1e-5


def test_the_executor_returns_one_pooled_vector_per_whole_input(encoder: BertEncoder) -> None:
    executor = EncoderExecutor(encoder)
    seqs = [_seq("a", [2, 20, 3]), _seq("b", [2, 21, 22, 3])]
    out = executor.execute(ModelInput(seqs, block_size=8))
    assert set(out) == {"a", "b"} and all(isinstance(v, Pooled) for v in out.values())
    pooled = out[RequestId("a")]
    assert isinstance(pooled, Pooled)
    assert pooled.embedding == pytest.approx(encoder.embed([[2, 20, 3]])[0], abs=1e-5)
    chunk = ScheduledSequence(RequestId("c"), [20, 3], 1, [0], True, SamplingParams(), [],
                              [2, 20, 3], is_pooling=True)
    with pytest.raises(RuntimeError, match="encoder inputs run whole"):
        executor.execute(ModelInput([chunk], block_size=8))


def test_the_config_says_pooling_normalization_and_matryoshka(tmp_path: Path,
                                                              bert_dir: Path) -> None:
    cfg = encoder_config(bert_dir)
    assert (cfg.hidden_size, cfg.pooling, cfg.normalize, cfg.is_matryoshka) == \
        (HIDDEN, "mean", True, False)
    assert cfg.allows_dimensions(HIDDEN) and not cfg.allows_dimensions(8)
    mrl = encoder_config(make_tiny_bert_dir(tmp_path / "mrl", matryoshka_dimensions=[8, 16]))
    assert mrl.allows_dimensions(8) and not mrl.allows_dimensions(9)
    assert is_encoder_dir(bert_dir) and not is_encoder_dir(tmp_path)


def test_a_decoder_directory_is_not_an_encoder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    assert not is_encoder_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="not a BERT encoder"):
        encoder_config(tmp_path)


def _seq(request_id: str, token_ids: list[int]) -> ScheduledSequence:
    return ScheduledSequence(RequestId(request_id), token_ids, 0, [0], True, SamplingParams(),
                             [], token_ids, is_pooling=True)
