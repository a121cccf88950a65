"""The tokenizer: ids of the tiny byte-level BPE, and chat templates rendered in a sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import CHATML_TEMPLATE, MERGES, make_tiny_tokenizer_json
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import InvalidRequestError, ModelLoadError
from strata.model.tokenizer import Tokenizer, byte_level_bpe

ENDOFTEXT, IM_START, IM_END = 256 + len(MERGES), 257 + len(MERGES), 258 + len(MERGES)


def _tokenizer(tmp_path: Path, template: str | None = CHATML_TEMPLATE) -> Tokenizer:
    file = tmp_path / "tokenizer.json"
    file.write_text(make_tiny_tokenizer_json(), encoding="utf-8")
    return Tokenizer.from_file(
        file, chat_template=template, eos_token_ids=[ENDOFTEXT],
        bos_token="<|im_start|>", eos_token="<|im_end|>",
    )


def test_byte_tokens_merges_and_special_ids(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    assert tok.vocab_size == 256 + len(MERGES) + 3
    # merges by rank: "he" (id 257) before "ell", " the" (258), "ll" (264); bytes keep their value
    assert tok.encode(" the hello") == [258, 32, 257, 264, 111]
    assert tok.encode("<|im_start|>user") == [IM_START, 117, 115, 261]  # "er" is merge 5
    assert tok.bos_token_id == IM_START
    assert tok.eos_token_ids == (ENDOFTEXT, IM_END)


def test_unicode_roundtrip(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    assert ids[:5] == [104, 195, 169, 264, 111]  # h, é as two bytes, ll, o
    assert tok.decode(ids) == text


def test_decode_skips_special_tokens_unless_asked(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.id_to_token_text(258) == " the"
    assert tok.id_to_token_text(IM_END) == "<|im_end|>"


def test_chatml_rendering(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.has_chat_template
    assert tok.apply_chat_template(messages) == prompt + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == prompt
    assert tok.encode(prompt)[:2] == [IM_START, 115]


def test_template_helpers_tojson_bos_eos_and_strftime(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
        "{{ eos_token }}{{ strftime_now('%Y') | length }}"
    )
    tok = _tokenizer(tmp_path, template)
    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<|im_start|>{"role": "user", "content": "é"}\n<|im_end|>4'


def test_raise_exception_in_template_is_a_400(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
    tok = _tokenizer(tmp_path, template + "{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user") as info:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user"}], [{"role": "user", "content": ["a list"]}], [{"content": 3}]],
    ids=["no-content", "list-content", "no-role"],
)
def test_bad_messages_give_invalid_request(tmp_path: Path, messages: list[dict]) -> None:
    tok = _tokenizer(tmp_path)
    with pytest.raises(InvalidRequestError, match="chat template cannot render"):
        tok.apply_chat_template(messages)


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_clear_400(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, None)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_syntax_error_is_a_load_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: chat template has a syntax"):
        _tokenizer(tmp_path, "{% for m in messages %}")


def test_invalid_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        Tokenizer.from_file(bad, chat_template=None)


def test_byte_level_bpe_from_gguf_arrays_matches_tokenizer_json() -> None:
    spec = json.loads(make_tiny_tokenizer_json())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [" ".join(m) for m in spec["model"]["merges"]]
    built = byte_level_bpe(tokens, merges, [1] * (len(tokens) - 3) + [3, 3, 3])
    original = HFTokenizer.from_str(make_tiny_tokenizer_json())
    for text in ["the hello world", "<|im_start|>user\nhéllo 世界 🙂<|im_end|>", "  a\n\nb 12"]:
        assert built.encode(text).ids == original.encode(text).ids


def test_smollm_pre_tokenizer_splits_digits_one_by_one() -> None:
    tokens = [chr(c) for c in range(33, 127)] + ["12"]
    gpt2 = byte_level_bpe(tokens, ["1 2"], [1] * len(tokens))
    smollm = byte_level_bpe(tokens, ["1 2"], [1] * len(tokens), pre="smollm")
    assert gpt2.encode("12").ids == [len(tokens) - 1]
    assert smollm.encode("12").ids == [ord("1") - 33, ord("2") - 33]
