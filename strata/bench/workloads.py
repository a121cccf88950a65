"""The standard workloads of docs/BENCHMARKS: fixed lengths, shared prefix, multi-turn sessions.

Builders are pure: given a seed they always produce the same prompts. Completion prompts are
token-id lists of exactly the requested length, drawn from a `pool` of ids (the ids of random
words, so that every id decodes to ordinary text). Chat turns are random words.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

WORKLOADS = ("fixed", "shared-prefix", "multi-turn")

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


@dataclass(frozen=True, slots=True)
class CompletionItem:
    """One /v1/completions request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class ChatSession:
    """A conversation: each user turn is sent with the whole history before it."""

    user_turns: list[str]
    output_len: int


def random_words(rng: random.Random, num_words: int) -> str:
    """`num_words` words from a fixed list, separated by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _ids(rng: random.Random, pool: Sequence[int], length: int) -> list[int]:
    return [rng.choice(pool) for _ in range(length)]


def _check_pool(pool: Sequence[int]) -> None:
    if not pool:
        raise ValueError("the token pool is empty: /tokenize returned no ids")


def build_fixed(
    num_requests: int, input_len: int, output_len: int, pool: Sequence[int], *, seed: int
) -> list[CompletionItem]:
    """`num_requests` independent prompts of `input_len` tokens each."""
    _check_pool(pool)
    rng = random.Random(seed)
    return [CompletionItem(_ids(rng, pool, input_len), output_len) for _ in range(num_requests)]


def build_shared_prefix(
    num_requests: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    pool: Sequence[int],
    *,
    seed: int,
) -> list[CompletionItem]:
    """One common prefix of `prefix_len` tokens followed by a unique `input_len`-token suffix."""
    _check_pool(pool)
    rng = random.Random(seed)
    prefix = _ids(rng, pool, prefix_len)
    return [
        CompletionItem(prefix + _ids(rng, pool, input_len), output_len)
        for _ in range(num_requests)
    ]


def build_multi_turn(
    num_sessions: int, num_turns: int, words_per_turn: int, output_len: int, *, seed: int
) -> list[ChatSession]:
    """`num_sessions` conversations of `num_turns` user turns of `words_per_turn` words."""
    rng = random.Random(seed)
    return [
        ChatSession([random_words(rng, words_per_turn) for _ in range(num_turns)], output_len)
        for _ in range(num_sessions)
    ]
