"""Mid-stream resume: a stream whose instance fails after the client got its first bytes goes on
on another instance, and the client sees one unbroken stream (the protocol between gateway and
instances is strata/protocol/resume.py).

    Resumer.headers       ask the instance to mark a stream the gateway may resume
    Resumer.record        a `StreamRecord` of a marked stream: it keeps the marks and hands the
                          client the frames without them (the bytes of an unmarked stream)
    Resumer.next_request  the POST /v1/strata/resume that continues a broken record, or None

What is resumed: a streamed /v1/completions or /v1/chat/completions with one choice (instances
mark only those), a prefill/decode hand-off's decode leg included (/internal/decode/...: it is
resumed on any decode or mixed instance, from the prompt and the tokens sent, as a plain stream)
whose instance failed after its first frame (a reset or closed connection, a read timeout, a stall
that a failed probe ended: strata/gateway/upstream/stalls.py; or its engine failed and it ended the
stream with finish reason "error": that frame and what follows it are not relayed), at most
`max_resumes` times per stream, each time on an instance of the same model version that this
stream has not tried. The proxy routes the resume like a request (filters, policy, retries on
another instance while nothing came back), and relays the continuation under the frames
already sent. What is not: several choices, a stream whose client left, a resume refused.
Those end as before: an error event and [DONE]; a refusal is logged and its status and message
are in that event.

Identical tokens: the continuation starts from the prompt ids the first instance rendered and
the token ids the client was sent, so greedy and seeded streams are token for token those of an
unbroken run. An unseeded sampled stream is resumed too: a valid continuation drawn from the
same distribution, not the same tokens. A session turn is stored once, by whichever instance
finishes the stream (strata/server/resume.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from strata.gateway.config import ResumeConfig
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.requests import ProxyRequest
from strata.gateway.upstream.pools import UpstreamAnswer
from strata.protocol.pd import HANDOFF_HEADER, public_path
from strata.protocol.resume import (
    MARK,
    RESUMABLE_HEADER,
    RESUMABLE_PATHS,
    RESUME_PATH,
    read_mark,
)

logger = logging.getLogger("strata.gateway")

FRAME_END = b"\n\n"
ERROR_FINISH = b'"f":"error"'
SESSION_REVISION_HEADER = "x-session-revision"
RESUMABLE_FINISHES = ("stop", "length")
REFUSAL_BYTES = 4096  # of a refusal's body, read for its message


@dataclass(slots=True)
class StreamRecord:
    """What the client of one marked stream has been sent: the marks of every frame relayed."""

    request: ProxyRequest  # the client's
    session_revision: int | None = None  # X-Session-Revision of the first answer
    marks: list[bytes] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)  # instances this stream went to
    num_resumes: int = 0
    has_failed: bool = False  # the instance ended the stream with finish reason "error"
    refusal: str = ""  # why an instance refused to resume it

    def take(self, frames: bytes) -> bytes:
        """`frames` (whole SSE frames, maybe a partial one at the end of the stream) as the
        client gets them: without the mark lines, which are kept. From a frame marked with
        finish reason "error" on, nothing is kept: `has_failed` is set."""
        if MARK not in frames:
            return frames
        pieces = frames.split(FRAME_END)
        out: list[bytes] = []
        for i, piece in enumerate(pieces):
            lines = piece.split(b"\n")
            marks = [line for line in lines if line.startswith(MARK)]
            if any(ERROR_FINISH in mark for mark in marks):
                self.has_failed = True
                break
            kept = [line for line in lines if not line.startswith(MARK)]
            self.marks += marks
            if any(kept):
                out.append(b"\n".join(kept) + (FRAME_END if i < len(pieces) - 1 else b""))
        return b"".join(out)

    def explain(self, message: str) -> str:
        """The client's error `message` for this stream's break, with a refusal's reason."""
        return f"{message}; {self.refusal}" if self.refusal else message

    def resume_body(self) -> dict[str, Any] | None:
        """The body of POST /v1/strata/resume, or None when the stream cannot be resumed (no start
        mark; it ended some other way than stop or length)."""
        start: dict[str, Any] | None = None
        sent: list[int] = []
        finish: dict[str, Any] | None = None
        for line in self.marks:
            mark = read_mark(line)
            start = mark if "prompt" in mark else start
            sent += mark.get("t", [])
            if mark.get("f") is not None:
                finish = {"reason": mark["f"], "stop_reason": mark.get("s")}
        if start is None or (finish is not None and finish["reason"] not in RESUMABLE_FINISHES):
            return None
        body = self.request.body_json
        if body is None:
            return None
        return {"path": public_path(self.request.path), "request": body,
                "id": start["id"], "created": start["created"], "version": start["version"],
                "prompt_token_ids": start["prompt"], "output_token_ids": sent,
                "finish": finish, "session_revision": self.session_revision}


class Resumer:
    """Decides which streams are marked and builds their resumes (see the module docstring)."""

    def __init__(self, config: ResumeConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics

    def is_resumable(self, request: ProxyRequest) -> bool:
        if self.config.max_resumes == 0:
            return False
        return request.path == RESUME_PATH or (
            request.route.is_stream and public_path(request.path) in RESUMABLE_PATHS)

    def headers(self, request: ProxyRequest,
                headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The headers sent to the instance: marks asked for when the gateway may resume."""
        kept = [(k, v) for k, v in headers if k.lower() != RESUMABLE_HEADER]
        return [*kept, (RESUMABLE_HEADER, "1")] if self.is_resumable(request) else kept

    def record(self, request: ProxyRequest, response: UpstreamAnswer,
               instance_id: str) -> StreamRecord | None:
        """A record of the stream `response` starts, when it may be resumed."""
        if not self.is_resumable(request) or request.path == RESUME_PATH:
            return None
        revision = response.headers.get(SESSION_REVISION_HEADER)
        return StreamRecord(request, int(revision) if revision and revision.isdigit() else None,
                            tried=[instance_id])

    def next_request(self, record: StreamRecord, now: float) -> ProxyRequest | None:
        """The resume of a broken `record`, or None (impossible, or no attempt left)."""
        body = record.resume_body() if record.num_resumes < self.config.max_resumes else None
        if body is None:
            self.metrics.resumes.labels("impossible").inc()
            return None
        record.num_resumes += 1
        original = record.request
        model, _, version = str(body["version"]).partition("@")
        route = dataclasses.replace(original.route, model=model, version=version)
        dropped = ("content-type", HANDOFF_HEADER)  # a P/D stream goes on without its handle
        return ProxyRequest("POST", RESUME_PATH, json.dumps(body).encode(),
                            [(k, v) for k, v in original.headers if k.lower() not in dropped]
                            + [("content-type", "application/json")], route, now,
                            deadline_s=original.deadline_s)

    async def refused(self, record: StreamRecord, instance_id: str,
                      response: UpstreamAnswer) -> None:
        """`response`, not a stream, refused the resume of `record` (no other instance is
        tried): logged, and told to the client."""
        reason = await refusal_of(response)
        logger.warning("instance %s refused to resume a stream of %s: %s", instance_id,
                       record.request.path, reason)
        record.refusal = f"its resume on instance {instance_id} was refused: {reason}"


async def refusal_of(response: UpstreamAnswer) -> str:
    """"STATUS message" of an answer that is not the resumed stream: the message of its OpenAI
    error body, else the start of its body."""
    try:
        body = (await response.aread())[:REFUSAL_BYTES]  # an error body: small
    except (httpx.HTTPError, OSError):
        body = b""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, TypeError, KeyError):
        message = body[:200].decode(errors="replace")
    return f"{response.status_code} {message}".strip()


__all__ = ["Resumer", "StreamRecord", "refusal_of"]
