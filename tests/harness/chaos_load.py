"""Closed-loop load for chaos tests and soaks (tests/chaos, bench/chaos.py, bench/soak.py).

    load = ChaosLoad(gateway_url, model, num_conversations=4, num_streams=4).start()
    ... inject a fault at `fault_at = time.monotonic()` ...
    result = load.stop()                     # every request's outcome
    lost = check_sessions(gateway_url, result)  # acknowledged turns missing from the store

Conversations are multi-turn sessions (`X-Session-Id`, only the new user message sent), every
other turn streamed; a failed turn is retried (the same message) until it succeeds, as a client
would. Stream workers send independent greedy chat streams, every third one not streamed. A
request succeeds when it got a 200 and, for a stream, `[DONE]` with no error event. The load
runs on an event loop of its own thread, so the caller injects faults from its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from strata.errors import ChatError

RETRY_PAUSE_S = 0.2


@dataclass(slots=True)
class Outcome:
    kind: str  # "turn" (of a session) or "request" (no session)
    started_at: float
    ended_at: float
    is_ok: bool
    error: str = ""
    is_stream: bool = False
    max_gap_s: float = 0.0  # the longest wait between two chunks of a stream


@dataclass(slots=True)
class Conversation:
    session_id: str
    acked: list[tuple[str, str]] = field(default_factory=list)  # (user message, answer)


@dataclass(slots=True)
class LoadResult:
    outcomes: list[Outcome]
    conversations: list[Conversation]

    @property
    def num_sent(self) -> int:
        return len(self.outcomes)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.is_ok]

    @property
    def num_turns_acked(self) -> int:
        return sum(len(c.acked) for c in self.conversations)

    def recovery_s(self, fault_at: float) -> float:
        """From the fault to the end of the last request that failed after it (0: none did)."""
        ends = [o.ended_at for o in self.failures if o.ended_at >= fault_at]
        return max(ends) - fault_at if ends else 0.0

    def max_gap_s(self, since: float = 0.0) -> float:
        gaps = [o.max_gap_s for o in self.outcomes if o.ended_at >= since and o.is_ok]
        return max(gaps, default=0.0)


class ChaosLoad:
    """The load (see the module docstring); `start` returns at once, `stop` returns results."""

    def __init__(self, url: str, model: str, *, num_conversations: int = 4,
                 num_streams: int = 4, max_tokens: int = 24, timeout_s: float = 60.0,
                 headers: Mapping[str, str] | None = None, prefix: str = "chaos",
                 turns_per_session: int | None = None) -> None:
        self.url = url
        self.model = model
        self.prefix = prefix
        self.turns_per_session = turns_per_session  # then a new session starts (soaks)
        self.num_streams = num_streams
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.num_conversations = num_conversations
        self.conversations: list[Conversation] = []
        self.outcomes: list[Outcome] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ChaosLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True,
                                        name="chaos-load")
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> LoadResult:
        """Let requests in flight finish (at most their timeout), then return every outcome."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return LoadResult(list(self.outcomes), list(self.conversations))

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s,
                                     limits=limits) as client:
            await asyncio.gather(*(self._converse(client, i)
                                   for i in range(self.num_conversations)),
                                 *(self._streams(client, i) for i in range(self.num_streams)))

    def _new_conversation(self, worker: int) -> Conversation:
        conversation = Conversation(f"{self.prefix}-{worker}-{time.time_ns()}")
        self.conversations.append(conversation)
        return conversation

    async def _converse(self, client: httpx.AsyncClient, worker: int) -> None:
        conversation = self._new_conversation(worker)
        while not self._stopping.is_set():
            turn = len(conversation.acked)
            if self.turns_per_session is not None and turn >= self.turns_per_session:
                conversation = self._new_conversation(worker)
                turn = 0
            message = f"turn {turn} of {conversation.session_id}: go on with the story"
            headers = {**self.headers, "X-Session-Id": conversation.session_id}
            outcome, answer = await self._chat(client, message, "turn", turn % 2 == 1, headers)
            if outcome.is_ok:
                conversation.acked.append((message, answer))
            else:
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _streams(self, client: httpx.AsyncClient, worker: int) -> None:
        n = 0
        while not self._stopping.is_set():
            is_stream = n % 3 != 2
            outcome, _ = await self._chat(client, f"stream {worker}.{n}: tell me about the sea",
                                          "request", is_stream, self.headers)
            n += 1
            if not outcome.is_ok:
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _chat(self, client: httpx.AsyncClient, message: str, kind: str, is_stream: bool,
                    headers: dict[str, str]) -> tuple[Outcome, str]:
        body = {"model": self.model, "messages": [{"role": "user", "content": message}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": is_stream}
        outcome = Outcome(kind if kind == "turn" else "request", time.monotonic(), 0.0, False,
                          is_stream=is_stream)
        answer = ""
        try:
            if is_stream:
                answer = await self._read_stream(client, body, headers, outcome)
            else:
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                if response.status_code != 200:
                    raise ChatError(f"{response.status_code}: {response.text[:200]}")
                answer = response.json()["choices"][0]["message"]["content"]
            outcome.is_ok = True
        except ChatError as exc:
            outcome.error = str(exc)
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.ended_at = time.monotonic()
        self.outcomes.append(outcome)
        return outcome, answer

    async def _read_stream(self, client: httpx.AsyncClient, body: dict[str, Any],
                           headers: dict[str, str], outcome: Outcome) -> str:
        parts: list[str] = []
        is_done = False
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as response:
            if response.status_code != 200:
                raise ChatError(f"{response.status_code}: {(await response.aread())[:200]!r}")
            last = time.monotonic()
            async for line in response.aiter_lines():
                now = time.monotonic()
                outcome.max_gap_s, last = max(outcome.max_gap_s, now - last), now
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    is_done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise ChatError(f"error event: {event['error'].get('message', '')[:200]}")
                for choice in event.get("choices", []):
                    parts.append(choice.get("delta", {}).get("content") or "")
        if not is_done:
            raise ChatError("the stream ended without [DONE]")
        return "".join(parts)


@dataclass(frozen=True, slots=True)
class SessionCheck:
    num_lost: int  # acknowledged turns not in the stored history (in order)
    num_duplicated: int  # user messages stored more than once (a retried turn stored twice)


def check_sessions(url: str, result: LoadResult, headers: Mapping[str, str] | None = None,
                   timeout_s: float = 30.0) -> SessionCheck:
    """Every acknowledged turn must be in its session, in order, with its answer."""
    lost = duplicated = 0
    for conversation in result.conversations:
        if not conversation.acked:
            continue
        response = httpx.get(f"{url}/v1/sessions/{conversation.session_id}",
                             headers=dict(headers or {}), timeout=timeout_s)
        messages = response.json().get("messages", []) if response.status_code == 200 else []
        pairs = [(m.get("content"), n.get("content"))
                 for m, n in zip(messages, messages[1:], strict=False)
                 if m.get("role") == "user" and n.get("role") == "assistant"]
        position = 0
        for turn in conversation.acked:
            try:
                position = pairs.index(turn, position) + 1
            except ValueError:
                lost += 1
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        duplicated += len(users) - len(set(users))
    return SessionCheck(lost, duplicated)


def gateway_counter(url: str, name: str, labels: str = "") -> float:
    """A counter of the gateway's /metrics (0 when absent or unreachable)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    wanted = f"{name}{{{labels}}}" if labels else name
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(wanted + " ")]
    return values[0] if values else 0.0


__all__ = ["ChaosLoad", "Conversation", "LoadResult", "Outcome", "SessionCheck",
           "check_sessions", "gateway_counter"]
