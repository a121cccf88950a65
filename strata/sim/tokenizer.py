"""A small byte-level BPE tokenizer built in code, for simulated instances (no files, no torch).

Ids 0..255 are the bytes (GPT-2's byte alphabet); then one merge chain per common English word
so that " word" is one token, as in real vocabularies (prompts of words cost about as many tokens
as with a real model); then the ChatML special tokens. Generated text is drawn from the word
tokens (`word_token_ids`), so it decodes to readable words and never contains a special token.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from strata.model.tokenizer import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = (
    "the of and to in is that for it was on are as with be at by this have from or one had not "
    "but what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life "
    "enough took sometimes four head above kind began almost live page got earth need far hand "
    "high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days ever paper hard near sentence better "
    "best across during today others however sure means knew try told young miles sun ways "
    "thing whole hear example heard several change answer room sea against top turned learn "
    "point city play toward five using himself usually money system program question family "
    "student group problem state week company government business issue service power game"
).split()


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: token id == byte value."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _word_merges(words: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """Merge chains Ġ+w0, Ġw0+w1, ... for each word: every left side starts with Ġ, so the
    chains of different words never split one another."""
    merges: dict[tuple[str, str], None] = {}
    for word in words:
        piece = "Ġ"
        for ch in word:
            merges[(piece, ch)] = None
            piece += ch
    return list(merges)


def build_hf_tokenizer() -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(byte_alphabet())}
    merges = _word_merges(WORDS)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tk


def build_sim_tokenizer() -> Tokenizer:
    """The simulated model's tokenizer: ChatML template, EOS `<|im_end|>`."""
    tk = build_hf_tokenizer()
    end_of_text: int = tk.token_to_id("<|endoftext|>")  # type: ignore[assignment]
    return Tokenizer(tk, chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>",
                     eos_token_ids=(end_of_text,), source="simulated")


def word_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of " word" for every word: what the simulated model generates."""
    ids = [tokenizer.token_to_id("Ġ" + w) for w in WORDS]
    return sorted({i for i in ids if i is not None})
