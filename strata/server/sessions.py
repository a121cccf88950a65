"""Chat sessions on an instance: history from the session store, one stored turn per answer.

A chat request names its session with the `X-Session-Id` header or `session_id` in the body.
The instance loads the session (of the caller's tenant: the sha256 of its API key, or
"anonymous" when the server has no keys), prepends the stored history to the request's messages,
generates, and stores the request's messages plus the answer as ONE append guarded by the
revision read at the start. The response carries `X-Session-Id` and `X-Session-Revision` (the
revision the session has once this turn is stored).

Concurrency rule. Two turns of one session that reach the same instance are serialised: a
per-session lock is held from the history read to the append, so the second turn sees the first
turn's answer. Across instances the revision decides: if another instance stored a turn in the
meantime, the append fails and the request gets 409 `session_conflict`; its answer is not stored
and the client retries the turn (sticky routing makes this rare). No message is ever lost or
interleaved: every stored turn extends exactly the history its answer was generated from.

Only completed answers are stored (every choice finished with `stop` or `length`); errors,
aborts and disconnects leave the session as it was. With n > 1 there would be several answers
to store, so a session request must have n = 1.

Context policy. If history + new messages + max_tokens (1 when unset) do not fit in the context,
the oldest turns (a user message and what follows it) are left out of the prompt, keeping a
leading system message, until they fit; the store keeps the whole history. The number left out
is reported in `X-Strata-Session-Truncated` and in the body's `strata.session_truncated_turns`.
If even the new messages alone do not fit, the request is a 400.

Routes (session_routes.py): GET /v1/sessions, GET /v1/sessions/{id}, DELETE /v1/sessions/{id};
another tenant's session is a 404 exactly like an unknown one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from strata.errors import (
    ContextLengthError,
    InvalidRequestError,
)
from strata.protocol.keys import caller_of
from strata.protocol.openai import ChatCompletionRequest, ChatMessage
from strata.protocol.sse import DONE_FRAME, encode_event
from strata.server import translate as tr
from strata.server.config import ServerConfig
from strata.server.errors import map_exception
from strata.server.generation import ChoiceState, Generation
from strata.server.request_io import SSEResponse
from strata.state.sessions import SessionStore, WriteBehindSessionStore

Message = dict[str, Any]
STORED_FINISH_REASONS = frozenset({"stop", "length"})
MAX_SESSION_ID_CHARS = 256
ANONYMOUS = "anonymous"




class KeyedLocks:
    """One asyncio.Lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    async def acquire(self, key: tuple[str, str]) -> None:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:
            self._forget(key)
            raise

    def release(self, key: tuple[str, str]) -> None:
        self._locks[key][0].release()
        self._forget(key)

    def __len__(self) -> int:
        return len(self._locks)

    def _forget(self, key: tuple[str, str]) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)


def tenant_of(request: Request) -> str:
    """The caller's tenant as the auth middleware found it (a client key's sha256 prefix, or
    the one the gateway forwards with the internal key: strata/protocol/keys.py); ANONYMOUS on
    a server without client keys."""
    return cache_tenant(request) or ANONYMOUS


def cache_tenant(request: Request) -> str | None:
    """The tenant whose cache namespace a request uses; None for the one tenant of a server
    without client keys (the namespace is the request's own `cache_salt` alone)."""
    return caller_of(request.scope).tenant


def session_id_of(request: Request, body: bytes) -> str | None:
    """The header, else the body's `session_id`; both given must agree."""
    header = request.headers.get("x-session-id")
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {}
    from_body = data.get("session_id") if isinstance(data, dict) else None
    if from_body is not None and not isinstance(from_body, str):
        raise InvalidRequestError("session_id must be a string", param="session_id")
    if header is not None and from_body is not None and header != from_body:
        raise InvalidRequestError("X-Session-Id and the body's session_id differ; send one",
                                  param="session_id")
    found = header if header is not None else from_body
    if found is not None and not 0 < len(found) <= MAX_SESSION_ID_CHARS:
        raise InvalidRequestError(f"session id must have 1..{MAX_SESSION_ID_CHARS} characters",
                                  param="session_id")
    return found


@dataclass(slots=True)
class SessionTurn:
    """One chat turn of a session: the lock is held until `release`."""

    sessions: Sessions
    session_id: str
    tenant: str
    base_revision: int
    new_messages: list[Message]
    request: ChatCompletionRequest  # the history prepended
    num_truncated_turns: int
    stored_revision: int | None = None  # set once the turn is stored
    is_released: bool = False

    @property
    def revision(self) -> int:
        """The stored revision; before the store (a stream's headers), the one it will get."""
        return self.stored_revision if self.stored_revision is not None \
            else self.base_revision + 1

    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session_id, "X-Session-Revision": str(self.revision),
                "X-Strata-Session-Truncated": str(self.num_truncated_turns)}

    def info(self) -> dict[str, Any]:
        """The `strata` field of a non-streamed response (after `commit`)."""
        return {"session_id": self.session_id, "session_revision": self.revision,
                "session_stored": self.stored_revision is not None,
                "session_truncated_turns": self.num_truncated_turns}

    async def commit(self, choices: Sequence[ChoiceState]) -> bool:
        """Store the turn if the answer completed; False when it was not stored."""
        if not choices or any(c.finish_reason not in STORED_FINISH_REASONS for c in choices):
            return False
        answer = {"role": "assistant", "content": choices[0].text}
        config = self.sessions.config  # store errors reach the one error table as they are
        record = await self.sessions.store.append(
            self.session_id, tenant=self.tenant, expected_revision=self.base_revision,
            messages=[*self.new_messages, answer], model=config.served_model_name,
            version=config.model_version, ttl_s=config.session_ttl_s)
        self.stored_revision = record.revision
        return True

    async def stream(self, frames: AsyncGenerator[bytes, None],
                     choices: Sequence[ChoiceState]) -> AsyncGenerator[bytes, None]:
        """The chat SSE frames; the turn is stored after the last token, before [DONE]. A failed
        store is reported as an error event (the answer was sent but is not in the session)."""
        async for frame in frames:
            if frame == DONE_FRAME:
                try:
                    await self.commit(choices)
                except Exception as exc:
                    yield encode_event(map_exception(exc).payload())
            yield frame

    def stream_response(self, request: Request, frames: AsyncGenerator[bytes, None],
                        generation: Generation) -> SSEResponse:
        """A streamed turn's response: stored after the last token (`stream`); the generation
        closed and the session released however the stream ends."""
        async def close() -> None:
            try:
                await generation.close()
            finally:
                self.release()

        return SSEResponse(request, self.stream(frames, generation.choices), close,
                           self.headers())

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.sessions.locks.release((self.tenant, self.session_id))


@dataclass(slots=True)
class Sessions:
    """The instance's sessions: the store, the config and the per-session locks."""

    store: SessionStore
    config: ServerConfig
    max_model_len: int
    tokenizer: tr.ServerTokenizer
    locks: KeyedLocks = field(default_factory=KeyedLocks)

    async def begin(self, request: Request, req: ChatCompletionRequest,
                    session_id: str) -> SessionTurn:
        """Lock the session, read it and build the request with its history."""
        if req.n != 1:
            raise InvalidRequestError("n must be 1 in a session (one answer is stored)",
                                      param="n")
        if isinstance(self.store, WriteBehindSessionStore):
            self.store.admit()  # a turn the queue cannot take is refused before it generates
        tenant = tenant_of(request)
        await self.locks.acquire((tenant, session_id))
        try:
            return await self._read(req, session_id, tenant)
        except BaseException:
            self.locks.release((tenant, session_id))
            raise

    async def _read(self, req: ChatCompletionRequest, session_id: str,
                    tenant: str) -> SessionTurn:
        record = await self.store.get(session_id, tenant=tenant)
        history = list(record.messages) if record is not None else []
        new = tr.chat_messages(req.messages)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        kept, num_dropped = self.fit(history, new, max(requested or 1, 1))
        with_history = req.model_copy(update={
            "messages": [ChatMessage.model_validate(m) for m in kept] + list(req.messages)})
        return SessionTurn(self, session_id, tenant, record.revision if record else 0, new,
                           with_history, num_dropped)

    def fit(self, history: list[Message], new: list[Message],
            num_generated: int) -> tuple[list[Message], int]:
        """The history to prepend (oldest turns dropped, a leading system message kept) and
        how many turns were dropped: the fewest that make the prompt fit."""
        system = history[:1] if history and history[0].get("role") == "system" else []
        turns = split_turns(history[len(system):])

        def kept(num_dropped: int) -> list[Message]:
            return system + [m for turn in turns[num_dropped:] for m in turn]

        def fits(num_dropped: int) -> bool:
            num_tokens = self._num_tokens(kept(num_dropped) + new) + num_generated
            return num_tokens <= self.max_model_len

        if fits(0):  # the common case: one tokenization
            return kept(0), 0
        if not fits(len(turns)):
            raise ContextLengthError(
                f"the new messages with max_tokens {num_generated} do not fit in the context of "
                f"{self.max_model_len} tokens even without the session's history; shorten the "
                "message or lower max_tokens", param="messages")
        # Dropping a turn never adds tokens, so bisect: O(log turns) tokenizations of the
        # history on the event loop, not one per turn.
        low, high = 1, len(turns)  # fits(high) holds, fits(low - 1) does not
        while low < high:
            mid = (low + high) // 2
            if fits(mid):
                high = mid
            else:
                low = mid + 1
        return kept(low), low

    def _num_tokens(self, messages: list[Message]) -> int:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def split_turns(messages: list[Message]) -> list[list[Message]]:
    """Turns: each starts at a user message (anything before the first user message is one)."""
    turns: list[list[Message]] = []
    for message in messages:
        if not turns or message.get("role") == "user":
            turns.append([])
        turns[-1].append(message)
    return turns


__all__ = ["ANONYMOUS", "KeyedLocks", "SessionTurn", "Sessions", "session_id_of", "split_turns",
           "tenant_of"]
