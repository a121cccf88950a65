"""The resume protocol between a gateway and its instances: how a stream cut by an instance's
death goes on on another instance (strata/gateway/upstream/resume.py, strata/server/resume.py).

Marks. A streamed request that carries `X-Strata-Resumable: 1` and asks for one choice gets SSE
comment lines in its stream (SSE clients ignore comments; the gateway removes them):

    : strata {"id":..,"created":..,"version":"name@version","prompt":[ids]}   on the first frame
    : strata {"t":[ids]}                           on the frame of every engine output
    : strata {"t":[ids],"f":"stop","s":".."}       on the last one (finish reason, stop reason)

An output that released no text (held back for a possible stop string) still gets a frame: a
mark alone. So the gateway knows every token id the client has been sent, and the prompt as the
instance rendered it (a chat template, a session's history).

Resume. `POST /v1/strata/resume` with a `ResumeRequest`: the original body, the envelope (`id`,
`created`), the prompt and the tokens sent. The instance continues the generation with those
tokens already generated (none, when only the first frame had gone out: it starts from the
prompt; same seed and position, the remaining max_tokens, stop strings across the hand-over)
and streams only what comes next, under the same id; a session turn is stored
with the revision the broken stream announced, once. With `finish` (the stream broke after its
last token), nothing is generated: the instance sends what remained (usage, [DONE]) and stores
the session turn unless the first instance already had.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RESUMABLE_HEADER = "x-strata-resumable"
RESUME_PATH = "/v1/strata/resume"
MARK = b": strata "
RESUMABLE_PATHS = ("/v1/completions", "/v1/chat/completions")


class ResumeFinish(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: Literal["stop", "length"]
    stop_reason: str | int | None = None


class ResumeRequest(BaseModel):
    """The body of POST /v1/strata/resume."""

    model_config = ConfigDict(extra="forbid", strict=True)

    path: Literal["/v1/completions", "/v1/chat/completions"]
    request: dict[str, Any]  # the client's body, as it was sent
    id: str
    created: int
    version: str  # name@version of the instance that started the stream: no other may go on
    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int]  # may be empty: the stream broke after its first frame only
    finish: ResumeFinish | None = None
    session_revision: int | None = None  # X-Session-Revision of the first answer


def _mark(payload: dict[str, Any]) -> bytes:
    return MARK + json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def start_mark(*, id: str, created: int, version: str, prompt_token_ids: list[int]) -> bytes:
    """The comment line of a resumable stream's first frame."""
    return _mark({"id": id, "created": created, "version": version, "prompt": prompt_token_ids})


def tokens_mark(token_ids: list[int], finish_reason: str | None = None,
                stop_reason: str | int | None = None) -> bytes:
    """The comment line of one engine output (with its finish once finished)."""
    payload: dict[str, Any] = {"t": token_ids}
    if finish_reason is not None:
        payload["f"] = finish_reason
        payload["s"] = stop_reason
    return _mark(payload)


def mark_frame(marks: bytes, frame: bytes) -> bytes:
    """`frame` (an SSE event, or b"") with comment lines in front; a mark alone ends its frame."""
    if not marks:
        return frame
    return marks + (frame if frame else b"\n")


def read_mark(line: bytes) -> dict[str, Any]:
    """The payload of one mark line (with or without its newline)."""
    data = json.loads(line[len(MARK):])
    if not isinstance(data, dict):
        raise ValueError("a strata mark is a JSON object")
    return data


__all__ = ["MARK", "RESUMABLE_HEADER", "RESUMABLE_PATHS", "RESUME_PATH", "ResumeFinish",
           "ResumeRequest", "mark_frame", "read_mark", "start_mark", "tokens_mark"]
