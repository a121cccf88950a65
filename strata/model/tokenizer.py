"""The model's tokenizer (Hugging Face `tokenizers`) and its chat template (jinja2).

A `Tokenizer` comes either from a `tokenizer.json` (`Tokenizer.from_file`) or from the vocabulary
stored in a GGUF file (`byte_level_bpe` builds the `tokenizers` object, as llama.cpp reads it).
Chat templates render in a sandbox; any failure caused by the messages is the caller's mistake
(`InvalidRequestError`), never a crash of the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import InvalidRequestError, ModelLoadError
from strata.protocol.chat_template import compile_chat_template, render_chat

# llama.cpp token types (gguf.TokenType): 3 = control (special), 4 = user defined.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp `tokenizer.ggml.pre` names whose pre-tokenizer differs from GPT-2's regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}
_SPLIT_REGEX_PRE = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text. Implements `TokenDecoder`."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        source: str = "tokenizer",
    ) -> None:
        self._tk = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = _token_id(tokenizer, bos_token)
        eos_id = _token_id(tokenizer, eos_token)
        extra = (eos_id,) if eos_id is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys((*eos_token_ids, *extra)))
        self.chat_template = chat_template
        self._template = _compile_template(chat_template, source) if chat_template else None

    @classmethod
    def from_file(
        cls,
        tokenizer_json: Path,
        *,
        chat_template: str | None,
        eos_token_ids: Sequence[int] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> Tokenizer:
        """Load a `tokenizer.json`; errors name the file."""
        try:
            tk = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{tokenizer_json}: not a valid tokenizer.json: {e}") from None
        return cls(
            tk,
            chat_template=chat_template,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=eos_token_ids,
            source=str(tokenizer_json),
        )

    def to_json(self) -> str:
        """The underlying `tokenizer.json` text (used by the GGUF cache)."""
        return str(self._tk.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tk.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def id_to_token_text(self, token_id: int) -> str:
        """The decoded text of one token (special tokens included), for logprobs."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return _token_id(self._tk, token)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` (and `tools`) into prompt text with the model's chat template."""
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions with a raw prompt",
                param="messages",
            )
        return render_chat(self._template, messages,
                           add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    *,
    pre: str = "gpt2",
) -> HFTokenizer:
    """A byte-level BPE tokenizer from llama.cpp's `tokenizer.ggml.*` arrays (model `gpt2`)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))  # type: ignore[arg-type]
    tk.pre_tokenizer = _pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL]
    user = [tokens[i] for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tk


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in _SPLIT_REGEX_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    return byte_level


def _token_id(tk: HFTokenizer, token: str | None) -> int | None:
    if token is None:
        return None
    found = tk.token_to_id(token)
    return None if found is None else int(found)


def _compile_template(source_text: str, source: str) -> jinja2.Template:
    # strata/protocol/chat_template.py: the gateway renders with the very same settings
    return compile_chat_template(source_text, source)
