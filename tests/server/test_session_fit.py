"""`Sessions.fit`: the fewest oldest turns dropped, found with few tokenizations."""

from __future__ import annotations

from typing import Any

import pytest

from strata.errors import ContextLengthError
from strata.server.config import ServerConfig
from strata.server.sessions import Message, Sessions
from strata.sim.tokenizer import build_sim_tokenizer
from strata.state.sessions import create_session_store

TOKENIZER = build_sim_tokenizer()
SYSTEM: Message = {"role": "system", "content": "be brief"}
NEW: list[Message] = [{"role": "user", "content": "and now"}]


class CountingTokenizer:
    """The simulator's tokenizer, counting chat-template renderings."""

    def __init__(self) -> None:
        self.num_renders = 0

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        self.num_renders += 1
        return TOKENIZER.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return TOKENIZER.encode(text, add_special_tokens=add_special_tokens)


def history(num_turns: int) -> list[Message]:
    turns = [[{"role": "user", "content": f"question {i} " + "word " * (i % 5)},
              {"role": "assistant", "content": f"answer {i}"}] for i in range(num_turns)]
    return [SYSTEM] + [m for turn in turns for m in turn]


def num_tokens(messages: list[Message]) -> int:
    text = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True)
    return len(TOKENIZER.encode(text, add_special_tokens=False))


def sessions(max_model_len: int) -> tuple[Sessions, CountingTokenizer]:
    tokenizer = CountingTokenizer()
    store = create_session_store("memory://")
    config = ServerConfig(served_model_name="m")
    return Sessions(store, config, max_model_len, tokenizer), tokenizer  # type: ignore[arg-type]


@pytest.mark.parametrize("num_dropped", [0, 1, 2, 17, 39, 40])
def test_the_fewest_oldest_turns_are_dropped(num_dropped: int) -> None:
    full = history(40)
    kept_expected = [SYSTEM, *full[1 + 2 * num_dropped :]]
    max_model_len = num_tokens(kept_expected + NEW) + 8  # exactly fits with 8 generated
    sess, tokenizer = sessions(max_model_len)
    kept, dropped = sess.fit(full, NEW, 8)
    assert (dropped, kept) == (num_dropped, kept_expected)
    assert tokenizer.num_renders <= 2 + 6  # not one per turn: 1 + 1 + ceil(log2(40))


def test_new_messages_that_never_fit_are_a_context_length_error() -> None:
    sess, _ = sessions(num_tokens([SYSTEM, *NEW]) + 7)
    with pytest.raises(ContextLengthError, match="even without the session's history"):
        sess.fit(history(5), NEW, 8)
