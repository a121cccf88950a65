"""The gateway keys a prompt exactly as the instance's engine names its blocks: the tokenizer and
template fetched from the instance, split at special tokens and memoised, give the very token
ids and block hashes the instance computes; text keys are the fallback."""

from __future__ import annotations

import json
import random

import pytest

from strata.gateway.routing.prefix.prompt import (
    TEXT_CHUNK_CHARS,
    Prompt,
    PromptHasher,
    prompt_of,
    text_keys,
)
from strata.server.kv_events import TokenizerSpec
from strata.sim.tokenizer import WORDS, build_sim_tokenizer
from strata.types import hash_blocks


@pytest.fixture(scope="module")
def instance_tokenizer():  # type: ignore[no-untyped-def]
    return build_sim_tokenizer()


@pytest.fixture(scope="module")
def hasher(instance_tokenizer) -> PromptHasher:  # type: ignore[no-untyped-def]
    return PromptHasher(json.loads(TokenizerSpec(instance_tokenizer).body))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_chat_prompts_hash_as_the_instance_engine_does(hasher, instance_tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    system = words(rng, 300) + " 42\n\n"
    for turn in range(6):  # the system prompt's piece is memoised after the first
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": words(rng, rng.randint(0, 40))}]
        text = instance_tokenizer.apply_chat_template(messages)
        ids = instance_tokenizer.encode(text, add_special_tokens=False)
        keyset = hasher.keys(Prompt(messages=messages, cache_salt="t1"), 16, "sim@v3")
        assert keyset.keys == tuple(hash_blocks(ids, 16, "sim@v3|t1")), turn
        assert keyset.num_prompt_tokens == len(ids) and keyset.tokens_per_key == 16


def test_completion_text_and_block_size_follow_the_instance(hasher, instance_tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = words(random.Random(5), 120) + "<|im_end|> tail"
    ids = instance_tokenizer.encode(text, add_special_tokens=True)
    assert hasher.keys(Prompt(text=text), 8, "sim@v").keys == tuple(hash_blocks(ids, 8, "sim@v|"))


def test_a_template_the_messages_break_is_an_error_the_feed_turns_into_text_keys(hasher) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception):  # noqa: B017 - any refusal: the instance will answer 400
        hasher.keys(Prompt(messages=[{"role": "user", "content": 3j}]), 16, "sim@v")


def test_prompt_of_reads_chat_completion_batches_and_ids() -> None:
    chat = prompt_of({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "cache_salt": "s"})
    assert chat == Prompt(messages=[{"role": "user", "content": "ab"}], cache_salt="s")
    assert prompt_of({"prompt": ["first", "second"]}) == Prompt(text="first")
    assert prompt_of({"prompt": [1, 2, 3]}) == Prompt(token_ids=[1, 2, 3])
    assert prompt_of({"prompt": []}) is None and prompt_of({"model": "m"}) is None


@pytest.mark.parametrize("ids", [[1, 2**70], [5, -1], [True, 2], [3, 2**31]])
def test_integers_that_are_no_token_ids_are_not_keyed(ids: list[int]) -> None:
    # a 65-bit id crashed the block hash (a 500 that schemathesis found); the instance answers
    # such a prompt with a 400, the gateway routes it by load
    assert prompt_of({"prompt": ids}) is None
    assert prompt_of({"prompt": [ids]}) is None


def test_text_keys_share_a_prefix_and_count_tokens_roughly() -> None:
    system = "x" * (TEXT_CHUNK_CHARS * 3)
    a = text_keys(Prompt(messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": "one" * 200}]))
    b = text_keys(Prompt(messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": "two" * 200}]))
    common = sum(1 for x, y in zip(a.keys, b.keys, strict=False) if x == y)
    assert common == 3 and a.keys[3] != b.keys[3]
    assert a.tokens_per_key == TEXT_CHUNK_CHARS // 4
    salted = text_keys(Prompt(messages=[{"role": "system", "content": system}], cache_salt="s"))
    assert salted.keys[0] != a.keys[0]
