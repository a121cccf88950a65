"""A request's prompt as index keys: the engine's block hashes when the gateway holds the
instance's tokenizer, else hashes of fixed-size chunks of the prompt's text.

Exact keys (`PromptHasher`): the chat template renders the messages and the tokenizer encodes
them exactly as the instance does (the tokenizer.json, template, BOS and EOS come from the
instance's GET /v1/strata/tokenizer; the template is compiled by the same code,
strata/protocol/chat_template.py), then the block hash chain of strata/types.py names the full
blocks with the instance's block size and namespace (`name@version|cache_salt`).

Speed: encoding a 1,100-token prompt costs about 1.3 ms here, and most of it is the tenant's
system prompt, the same in every request. The rendered text is split at the tokenizer's special
tokens (the tokenizer splits there itself, so the pieces encode independently), each piece's
token ids are memoised, and so is each step of the hash chain (state + piece -> state + hashes):
a request whose system prompt was seen before costs one dict lookup for it and the encoding and
hashing of its own suffix only. The splitting is checked at load against whole-text encoding on
probes; a tokenizer that fails the check (e.g. a SentencePiece "prepend first" scheme) is always
encoded whole.

Text keys (`text_keys`): a chain of blake2b over 256-character chunks of the messages' roles and
contents (or the prompt string); 256 characters are counted as 64 tokens. They serve instances
that publish no events or whose tokenizer is not loaded yet, matched against routing history
only.

A request that carries a session id has its history prepended at the instance: the gateway does
not see the real prompt, so it is routed without keys (by load).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from strata.gateway.routing.prefix.index import Key, PrefixIndex
from strata.protocol.chat_template import compile_chat_template, render_chat
from strata.types import BlockHash, hash_block

TEXT_CHUNK_CHARS = 256
# a token id the gateway keys: a vocabulary index (no tokenizer has 2**31 entries); a prompt
# with another integer is not keyed (routed by load) and its instance answers 400
MAX_TOKEN_ID = 2**31 - 1
CHARS_PER_TOKEN = 4
MEMO_ENTRIES = 4096
PROBE_TEXTS = ("Hello, world! ", "  two  spaces\n\nand lines\t", "digits 12345 and ünïcödé")


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a request asks the model to read: chat `messages`, or a completion's `text` or
    `token_ids` (the first prompt of a batch); `cache_salt` joins the namespace."""

    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class KeySet:
    """A prompt's keys for one kind of instance; each key stands for `tokens_per_key` tokens."""

    keys: tuple[Key, ...]
    tokens_per_key: int
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """The keys of a request for each candidate instance (instances alike share one KeySet)."""

    by_instance: dict[str, KeySet] = field(default_factory=dict)
    max_tokens: int = 0

    def for_instance(self, instance_id: str) -> KeySet | None:
        return self.by_instance.get(instance_id)


def prompt_of(data: dict[str, Any]) -> Prompt | None:
    """The prompt of a parsed chat or completion body; None when there is none to key."""
    salt = data.get("cache_salt") or ""
    messages = data.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return Prompt(messages=[_message(m) for m in messages], cache_salt=str(salt))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        return Prompt(text=prompt, cache_salt=str(salt))
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return Prompt(token_ids=list(prompt), cache_salt=str(salt))
    return None


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) \
        and 0 <= value <= MAX_TOKEN_ID


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """As the instance hands it to the template: content joined to one string."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    item: dict[str, Any] = {"role": message.get("role"), "content": content or ""}
    if message.get("name") is not None:
        item["name"] = message["name"]
    return item


def text_keys(prompt: Prompt) -> KeySet:
    """Chained hashes of the prompt's text in `TEXT_CHUNK_CHARS` chunks."""
    if prompt.messages is not None:
        text = "".join(f"{m['role']}\x1f{m['content']}\x1e" for m in prompt.messages)
    elif prompt.text is not None:
        text = prompt.text
    else:
        text = ",".join(map(str, prompt.token_ids or ()))
    keys: list[Key] = []
    parent = prompt.cache_salt.encode()
    for start in range(0, len(text) - TEXT_CHUNK_CHARS + 1, TEXT_CHUNK_CHARS):
        chunk = text[start:start + TEXT_CHUNK_CHARS].encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16, person=b"strata-text").digest()
        keys.append(parent)
    tokens_per_key = TEXT_CHUNK_CHARS // CHARS_PER_TOKEN
    return KeySet(tuple(keys), tokens_per_key, max(1, len(text) // CHARS_PER_TOKEN))


_Chain = tuple[BlockHash | None, tuple[int, ...]]  # (last full block's hash, leftover tokens)


class PromptHasher:
    """Prompt -> the instance's token ids -> the engine's block hashes, for one tokenizer."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as HFTokenizer  # only gateways that route by prefix

        self.fingerprint = str(spec.get("fingerprint", ""))
        self._tk = HFTokenizer.from_str(spec["tokenizer_json"])
        template = spec.get("chat_template")
        self._template = compile_chat_template(template, "the instance's chat template") \
            if template else None
        self._bos, self._eos = spec.get("bos_token"), spec.get("eos_token")
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chains: OrderedDict[tuple[object, ...], tuple[_Chain, tuple[Key, ...]]] = \
            OrderedDict()
        self._special = self._special_tokens()
        self._split = self._splitter() if self._special else None
        if self._split is not None and not self._splits_faithfully():
            self._split = None
        self._bos_ids, self._eos_ids = self._added_by_post_processor()

    def keys(self, prompt: Prompt, block_size: int, namespace: str) -> KeySet:
        """The prompt's full-block hashes as the instance's engine names them."""
        space = f"{namespace}|{prompt.cache_salt}"
        if prompt.token_ids is not None:
            return id_keys(prompt, block_size, namespace)
        if prompt.messages is not None:
            if self._template is None:
                raise ValueError("the instance's model has no chat template")
            text = render_chat(self._template, prompt.messages, add_generation_prompt=True,
                               bos_token=self._bos, eos_token=self._eos)
            start: tuple[int, ...] = ()
            end: tuple[int, ...] = ()
        else:
            text, start, end = prompt.text or "", self._bos_ids, self._eos_ids
        state: _Chain = (None, start)
        hashes: list[Key] = []
        num_tokens = len(start) + len(end)
        for piece in self._pieces_of(text):
            state, new, num = self._step(state, piece, block_size, space)
            hashes.extend(new)
            num_tokens += num
        if end:
            state, new = _extend(state, end, block_size, space)
            hashes.extend(new)
        return KeySet(tuple(hashes), block_size, num_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the instance encodes a rendered chat prompt."""
        return [t for piece in self._pieces_of(text) for t in self._piece_ids(piece)]

    def _step(self, state: _Chain, piece: str, block_size: int,
              space: str) -> tuple[_Chain, tuple[Key, ...], int]:
        memo_key = (space, block_size, state, piece)
        found = self._chains.get(memo_key)
        ids = self._piece_ids(piece)
        if found is None:
            found = _extend(state, ids, block_size, space)
            _remember(self._chains, memo_key, found)
        else:
            self._chains.move_to_end(memo_key)
        return found[0], found[1], len(ids)

    def _piece_ids(self, piece: str) -> tuple[int, ...]:
        special = self._special.get(piece)
        if special is not None:
            return (special,)
        ids = self._pieces.get(piece)
        if ids is None:
            ids = tuple(self._tk.encode(piece, add_special_tokens=False).ids)
            _remember(self._pieces, piece, ids)
        else:
            self._pieces.move_to_end(piece)
        return ids

    def _pieces_of(self, text: str) -> list[str]:
        if self._split is None:
            return [text] if text else []
        return [p for p in self._split.split(text) if p]

    def _special_tokens(self) -> dict[str, int]:
        """Special tokens the tokenizer matches verbatim (no strip or word rules)."""
        return {tok.content: tid for tid, tok in self._tk.get_added_tokens_decoder().items()
                if tok.special and not (tok.lstrip or tok.rstrip or tok.single_word)
                and not tok.normalized}

    def _splitter(self) -> re.Pattern[str]:
        ordered = sorted(self._special, key=len, reverse=True)
        return re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")")

    def _splits_faithfully(self) -> bool:
        specials = list(self._special)
        for text in PROBE_TEXTS:
            probe = specials[0] + text + specials[-1] + "\n" + text + specials[0] + text
            whole = self._tk.encode(probe, add_special_tokens=False).ids
            if whole != self.encode(probe):
                return False
        return True

    def _added_by_post_processor(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What encoding with special tokens adds around a text (BOS, EOS)."""
        plain = self._tk.encode("a", add_special_tokens=False).ids
        full = self._tk.encode("a", add_special_tokens=True).ids
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return tuple(full[:i]), tuple(full[i + len(plain):])
        return (), ()


def id_keys(prompt: Prompt, block_size: int, namespace: str) -> KeySet:
    """The block hashes of a prompt given as token ids (no tokenizer needed)."""
    token_ids = tuple(prompt.token_ids or ())
    _, hashes = _extend((None, ()), token_ids, block_size, f"{namespace}|{prompt.cache_salt}")
    return KeySet(hashes, block_size, len(token_ids))


def _extend(state: _Chain, ids: tuple[int, ...], block_size: int,
            space: str) -> tuple[_Chain, tuple[Key, ...]]:
    """The chain after `ids` more tokens: the hashes of the blocks they complete."""
    parent, leftover = state
    tokens = leftover + ids
    hashes: list[Key] = []
    num_full = len(tokens) // block_size
    for i in range(num_full):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], space)
        hashes.append(parent)
    return (parent, tokens[num_full * block_size:]), tuple(hashes)


def _remember(memo: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    memo[key] = value
    if len(memo) > MEMO_ENTRIES:
        memo.popitem(last=False)


def uncached_tokens(index: PrefixIndex, prefix: PrefixKeys | None, instance_id: str
                    ) -> int | None:
    """The prompt tokens `instance_id` would compute for a request with `prefix` keys: its
    prompt less the leading blocks the index says the instance holds; None without keys for
    it (the gateway knows nothing of that prompt on that instance)."""
    keyset = prefix.for_instance(instance_id) if prefix is not None else None
    if keyset is None:
        return None
    hit = index.match(instance_id, keyset.keys) * keyset.tokens_per_key
    return max(0, keyset.num_prompt_tokens - hit)


__all__ = ["uncached_tokens", "CHARS_PER_TOKEN", "KeySet", "PrefixKeys", "Prompt", "PromptHasher",
           "TEXT_CHUNK_CHARS", "id_keys", "prompt_of", "text_keys"]
