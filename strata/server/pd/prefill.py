"""P's side of a hand-off: answer a prefill-only request with a handle, stream the held blocks
to the D that pulls them (a D on this host reads them from the shared-memory pool instead:
pd/shm_pull.py), free them on the acknowledgement (or when the lease ends).

A prefill-only request is the client's request, validated as it is (so P refuses exactly what a
mixed instance would), then run with max_tokens 1 and its blocks held: P samples the first token
exactly as a mixed instance's first step would (same prompt, sampling parameters, seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from strata import tracing
from strata.engine.outputs import RequestOutput
from strata.engine.request import Request as EngineRequest
from strata.errors import EngineDeadError, InvalidRequestError, OverloadedError
from strata.protocol.errors import error_json
from strata.server import serving
from strata.server.cancel import CLIENT_DISCONNECT, cancel_of
from strata.server.pd.layout import ModeledLink
from strata.server.pd.leases import Lease
from strata.server.pd.state import PD, pd_of
from strata.server.pd.wire import Handle, block_frame, prompt_digest, stream_head
from strata.server.preamble import client_request
from strata.server.request_io import unless_cancelled
from strata.types import BlockHash

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
EXPORT_BATCH = 8  # blocks read per visit of the engine thread
Starter = Callable[[serving.ServingContext, M, Callable[[list[EngineRequest]], Awaitable[None]]],
                   Awaitable[serving.Started]]


class PrefillOnly:
    """The `prepare` hook of a prefill-only request: one engine request, first token only,
    blocks held."""

    def __init__(self) -> None:
        self.request: EngineRequest | None = None

    async def __call__(self, requests: list[EngineRequest]) -> None:
        if len(requests) != 1:
            raise InvalidRequestError("a prefill-only request has one prompt and n = 1")
        request = self.request = requests[0]
        request.sampling_params = dataclasses.replace(request.sampling_params, max_tokens=1)
        request.hold_blocks = True


async def prefill(request: Request, model: type[M], start: Starter[M]) -> Response:
    """POST /internal/prefill/v1/...: compute, hold, answer the handle."""
    instance, req = await client_request(request, model, task="generate")
    pd = pd_of(request)
    hook = PrefillOnly()
    started = await unless_cancelled(request, start(instance.serving, req, hook))
    first = started.generation.firsts[0]
    await started.generation.close()
    if hook.request is None or first.held is None:  # aborted or failed: nothing is held
        pd.metrics.handoffs.labels("prefill", "refused").inc()
        raise OverloadedError("the prefill did not finish; prefill locally", status_code=503)
    with tracing.span("strata.pd.handle") as opened:
        handle = grant(pd, hook.request, first)
        tracing.annotate(opened, **{"strata.pd.handle": handle.handle,
                                    "strata.pd.num_blocks": handle.num_blocks,
                                    "strata.pd.num_prompt_tokens": handle.num_prompt_tokens})
    await _unless_cancelled_now(request, pd, handle)
    pd.faults.reached("prefill_before_answer")
    pd.metrics.handoffs.labels("prefill", "answered").inc()
    return Response(handle.to_json(), media_type="application/json")


async def _unless_cancelled_now(request: Request, pd: PD, handle: Handle) -> None:
    """A handle whose caller left, or whose deadline passed, while the prompt was computed is
    never answered: its blocks go back to the engine now, not when the lease ends unpulled."""
    cancel = cancel_of(request)
    if not cancel.is_expired and not await request.is_disconnected():
        return
    pd.leases.ack(handle.handle, "cancelled")
    pd.note_held()
    pd.metrics.handoffs.labels("prefill", "cancelled").inc()
    if cancel.is_expired:
        raise cancel.expired()
    cancel.note(CLIENT_DISCONNECT)
    raise ClientDisconnect()


def grant(pd: PD, request: EngineRequest, first: RequestOutput) -> Handle:
    assert first.held is not None
    lease = pd.leases.grant(request.request_id, first.held)
    pd.note_held()
    logprob = first.new_logprobs[0] if first.new_logprobs else None
    namespace = pd.instance.engine.engine.cache_config.namespace
    return Handle(
        handle=lease.handle, epoch=pd.epoch, num_prompt_tokens=request.num_prompt_tokens,
        prompt_digest=prompt_digest(request.prompt_token_ids, namespace, request.cache_salt,
                                    request.lora_digest),
        num_blocks=len(first.held), token_id=first.new_token_ids[0],
        num_cached_tokens=first.num_cached_tokens, lease_s=pd.config.lease_s,
        logprob=logprob.logprob if logprob else None,
        top_logprobs=list(logprob.top) if logprob else [])


async def layout(request: Request) -> JSONResponse:
    """GET /internal/kv/layout: the handshake."""
    pd = pd_of(request)
    return JSONResponse({**pd.layout, "epoch": pd.epoch})


async def pull(request: Request) -> Response:
    """GET /internal/kv/{handle}?start=I&count=N: the held blocks I .. I+N-1 as a stream."""
    pd = pd_of(request)
    lease = pd.leases.begin_pull(request.path_params["handle"])
    if lease is None:
        return not_found()
    try:
        first, count = span_of(request, len(lease.held))
    except InvalidRequestError:
        pd.leases.end_pull(lease, is_complete=True)
        raise
    blocks = Blocks(pd, lease, first, count)
    return ClosingStream(blocks.frames(), blocks.close)


def span_of(request: Request, num_held: int) -> tuple[int, int]:
    """The pull's `start` and `count`; a 400 unless both are non-negative integers."""
    try:
        first = int(request.query_params.get("start", 0))
        count = int(request.query_params.get("count", num_held))
    except ValueError:
        first, count = -1, -1
    if first < 0 or count < 0:
        raise InvalidRequestError("start and count must be non-negative integers")
    return first, count


async def ack(request: Request) -> Response:
    """DELETE /internal/kv/{handle}: D is done with the blocks."""
    pd = pd_of(request)
    if not pd.leases.ack(request.path_params["handle"]):
        return not_found()
    pd.note_held()
    return Response(status_code=204)


def not_found() -> Response:
    message = "unknown hand-off handle (acknowledged, expired, or its instance restarted)"
    return Response(error_json(404, message), 404, media_type="application/json")


async def one_ahead(starts: Sequence[int],
                    begin: Callable[[int], Awaitable[T]]) -> AsyncGenerator[tuple[int, T]]:
    """(start, what `begin(start)` answered) for each start, in order; the next one is begun
    before this one is handed over, so the engine thread's work on batch k + 1 overlaps the
    send of batch k. What was begun and not handed over is cancelled when the iteration stops
    (iterate it under `contextlib.aclosing`)."""
    pending = [asyncio.ensure_future(begin(starts[0]))] if starts else []
    try:
        for i, start in enumerate(starts):
            result = await pending.pop()
            if i + 1 < len(starts):
                pending.append(asyncio.ensure_future(begin(starts[i + 1])))
            yield start, result
    finally:
        for future in pending:
            future.cancel()


class LeasedPull:
    """One pull of a lease's held blocks, by stream or by reference (pd/shm_pull.py). The lease
    counts the pull until `close` (whatever ends the response): one cut short is a broken pull.
    The engine thread reads the blocks a batch at a time between two of its steps (the executor
    has one driver), the next batch asked for before the current one is sent (`one_ahead`)."""

    def __init__(self, pd: PD, lease: Lease, first: int) -> None:
        self.pd, self.lease, self.first = pd, lease, first
        self.is_complete = False
        self.is_closed = False

    async def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.pd.leases.end_pull(self.lease, is_complete=self.is_complete)
            self.pd.note_held()


class Blocks(LeasedPull):
    """A pull by stream: the stream head, then each block with its chain hash,
    `EXPORT_BATCH` blocks per visit of the engine thread (`AsyncEngine.export_held`)."""

    def __init__(self, pd: PD, lease: Lease, first: int, count: int) -> None:
        super().__init__(pd, lease, first)
        self.block_ids = list(lease.held.block_ids[first : first + count])
        self.hashes = list(lease.held.block_hashes[first : first + count])

    async def frames(self) -> AsyncIterator[bytes]:
        yield stream_head(len(self.block_ids))
        starts = range(0, len(self.block_ids), EXPORT_BATCH)
        async with contextlib.aclosing(one_ahead(starts, self._export)) as batches:
            async for start, payloads in batches:
                if len(payloads) != len(self.block_ids[start : start + EXPORT_BATCH]):
                    return  # cannot export: D sees a truncated stream and recomputes
                for index, payload in enumerate(payloads, start):
                    yield self._frame(index, payload)
                    if index == 0:
                        self.pd.faults.reached("prefill_during_pull")
        self.is_complete = True

    async def _export(self, start: int) -> list[bytes]:
        """The payloads of the batch at `start`; [] when the engine can no longer read them."""
        try:
            payloads = await self.pd.instance.engine.export_held(
                self.lease.request_id, self.block_ids[start : start + EXPORT_BATCH])
        except EngineDeadError:
            return []
        link = self.pd.executor
        if payloads and isinstance(link, ModeledLink):
            await asyncio.sleep(link.link_s(len(payloads)))
        return payloads

    def _frame(self, index: int, payload: bytes) -> bytes:
        block_hash, payload = self.pd.faults.damage(
            self.first + index, BlockHash(self.hashes[index]), payload)
        self.pd.metrics.pull_bytes.labels("prefill").inc(len(payload))
        return block_frame(block_hash, payload)


class ClosingStream(StreamingResponse):
    """A binary stream whose `on_close` runs however it ends (done, client gone)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 media_type: str = "application/octet-stream") -> None:
        super().__init__(chunks, media_type=media_type)
        self._chunks = chunks
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # also when the client's leaving cancelled us
                aclose = getattr(self._chunks, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()


__all__ = ["Blocks", "ClosingStream", "LeasedPull", "PrefillOnly", "ack", "layout", "not_found",
           "one_ahead", "prefill", "pull", "span_of"]
