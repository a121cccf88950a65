"""Wire models, SSE framing and server config: small exact stories."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from strata.errors import ConfigError
from strata.protocol.openai import ChatCompletionRequest, CompletionRequest, UsageInfo
from strata.protocol.sse import DONE_FRAME, SSEParser, encode_event, parse_json_events
from strata.server.config import ServerConfig


def test_sse_frames_parse_back_whatever_the_chunking() -> None:
    stream = encode_event(UsageInfo(prompt_tokens=3)) + encode_event({"t": "é"}) + DONE_FRAME
    assert stream.startswith(b'data: {"prompt_tokens":3,') and stream.endswith(b"\n\n")
    pieces = [stream[i : i + 3] for i in range(0, len(stream), 3)]  # splits inside "é"
    events = list(parse_json_events(pieces))
    assert [e.get("prompt_tokens") for e in events] == [3, None]
    assert events[1] == {"t": "é"}
    parser = SSEParser()
    assert parser.feed(b": comment\ndata: a\ndata: b\n") == []
    assert parser.feed(b"\n") == ["a\nb"]


def test_requests_ignore_unknown_fields_but_not_wrong_types() -> None:
    req = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "logit_bias": {}, "n": 2})
    assert req.prompt == [[1, 2], [3]] and req.n == 2
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}],
         "stop": "x", "temperature": 1})
    assert chat.messages[0].text == "ab" and chat.stop_list == ["x"] and chat.temperature == 1.0
    for bad in ({"prompt": "x", "n": "2"}, {"prompt": "x", "stream": 1}, {"prompt": {"a": 1}}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})


def test_server_config_says_what_to_change() -> None:
    assert ServerConfig(served_model_name="m").max_body_bytes == 1 << 20
    with pytest.raises(ConfigError, match="max_n must be >= 1, got 0"):
        ServerConfig(served_model_name="m", max_n=0)
    with pytest.raises(ConfigError, match="served_model_name"):
        ServerConfig(served_model_name="")
