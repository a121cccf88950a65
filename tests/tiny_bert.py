"""A tiny random BERT encoder for tests: an HF directory (config.json, model.safetensors of a
randomly initialised `transformers.BertModel`, a WordPiece tokenizer.json written by
`BertTokenizerFast`), and the HF reference embedding (mean pooling + L2 normalize). Nothing is
downloaded."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
import torch.nn.functional as F

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "hello", "world", "cafe", "creme", "brulee", "naive", "resume", "quick", "fox",
         "emb", "##ed", "##ding", "##s", "##ing", "token", "##izer", "中", "文", "日", "本"]
VOCAB = (SPECIALS + WORDS + list(string.ascii_lowercase) + list(string.digits)
         + list(string.punctuation) + ["##" + c for c in string.ascii_lowercase + string.digits])
MAX_POSITIONS = 64
HIDDEN = 32


def make_tiny_bert_dir(path: Path, *, seed: int = 0,
                       matryoshka_dimensions: list[int] | None = None) -> Path:
    """Write a tiny BERT directory at `path` (hidden 32, 2 layers, 64 positions)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt"),
                                   do_lower_case=True).save_pretrained(path)
    config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=HIDDEN,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=MAX_POSITIONS,
                                     initializer_range=0.2)
    torch.manual_seed(seed)
    transformers.BertModel(config).save_pretrained(path)
    if matryoshka_dimensions is not None:
        file = path / "config.json"
        data = json.loads(file.read_text(encoding="utf-8"))
        data["matryoshka_dimensions"] = matryoshka_dimensions
        file.write_text(json.dumps(data), encoding="utf-8")
    return path


@torch.no_grad()
def hf_embeddings(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """HF's reference: BertTokenizerFast + BertModel (fp32), padded batch, masked mean, L2."""
    import transformers

    tokenizer = transformers.BertTokenizerFast.from_pretrained(model_dir)
    model = transformers.BertModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][:, :, None].float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
