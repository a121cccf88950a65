"""A terminal chat client: keeps the conversation, streams each answer as it is generated.

Type a message and press Enter; `/exit` or Ctrl-D leaves; Ctrl-C while an answer streams stops
that answer (the partial text stays out of the history).

With a session id the history lives on the server (its session store): each turn sends only the
new message with `X-Session-Id`, so the conversation survives the client, an instance or a gateway.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from strata.clients.sse import chunk_text, error_message
from strata.errors import ChatError
from strata.protocol.sse import parse_json_events

EXIT_COMMANDS = ("/exit", "/quit")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """Where to send messages and how to sample. `model` None lets the server pick its own."""

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    system: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    timeout_s: float = 600.0
    session_id: str | None = None  # history kept by the server under this id
    api_key: str | None = None

class Conversation:
    """The messages so far and the client that extends them by one turn at a time."""

    def __init__(self, client: httpx.Client, options: ChatOptions) -> None:
        self.client = client
        self.options = options
        self.messages: list[dict[str, str]] = []
        self._num_on_server = 0
        if options.system:
            self.messages.append({"role": "system", "content": options.system})

    def ask(self, prompt: str, on_text: Callable[[str], None]) -> str:
        """Send `prompt` with the history, call `on_text` with each streamed piece, return the
        answer. The turn enters the history only when the answer completed."""
        # with a session the server holds what it has seen: send only what it has not
        unsent = self.messages[self._num_on_server:] if self.options.session_id else self.messages
        body = self._body([*unsent, {"role": "user", "content": prompt}])
        pieces: list[str] = []
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body,
                                    headers=self._headers()) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise ChatError(error_message(resp))
                for event in parse_json_events(resp.iter_bytes()):
                    if isinstance(event.get("error"), dict):
                        raise ChatError(str(event["error"].get("message")))
                    text = chunk_text(event)
                    if text:
                        pieces.append(text)
                        on_text(text)
        except httpx.HTTPError as e:
            raise ChatError(
                f"cannot reach {self.options.url} ({e}); is `strata serve` running?"
            ) from None
        answer = "".join(pieces)
        self.messages += [{"role": "user", "content": prompt},
                          {"role": "assistant", "content": answer}]
        self._num_on_server = len(self.messages)
        return answer

    def _headers(self) -> dict[str, str]:
        headers = {}
        if self.options.session_id:
            headers["X-Session-Id"] = self.options.session_id
        if self.options.api_key:
            headers["Authorization"] = f"Bearer {self.options.api_key}"
        return headers

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": messages, "stream": True}
        optional = {"model": self.options.model, "temperature": self.options.temperature,
                    "max_tokens": self.options.max_tokens}
        body.update({k: v for k, v in optional.items() if v is not None})
        return body


def run_chat(
    options: ChatOptions,
    *,
    once: str | None = None,
    read_line: Callable[[str], str] = input,
    out: TextIO | None = None,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Chat until `/exit` or end of input (or answer `once` and return). Returns an exit code."""
    stream = out if out is not None else sys.stdout
    with httpx.Client(base_url=options.url, timeout=options.timeout_s,
                      transport=transport) as client:
        conversation = Conversation(client, options)
        if once is not None:
            return _turn(conversation, once, stream)
        return _loop(conversation, read_line, stream)


def _turn(conversation: Conversation, prompt: str, out: TextIO) -> int:
    def show(text: str) -> None:
        out.write(text)
        out.flush()

    try:
        conversation.ask(prompt, show)
    except ChatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        out.write(" [stopped]")
    out.write("\n")
    return 0


def _loop(conversation: Conversation, read_line: Callable[[str], str], out: TextIO) -> int:
    out.write(f"Chatting with {conversation.options.url}. /exit or Ctrl-D to leave.\n")
    while True:
        try:
            prompt = read_line("> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        if prompt in EXIT_COMMANDS:
            return 0
        if prompt:
            _turn(conversation, prompt, out)
