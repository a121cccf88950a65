"""D's side of a hand-off: pull the prompt's blocks from P, check each, hand them to the engine
with P's first token, answer the client exactly as a mixed instance would, acknowledge.

`HandoffPull` is the `prepare` hook of the request (it runs after validation, before the
engine sees the request):

0. the handle must be one this fleet wrote (pd/trust.py): sealed by the gateway with the
   internal key, or naming an instance the registry lists; a forged one is a 400 and nothing
   is contacted;
1. the handle must name this very prompt (length and digest over tokens, namespace, salt and
   LoRA adapter digest) and P must pass the layout handshake; otherwise the handle is ignored
   and D prefills locally, sampling its own first token (a token from another prompt, model or
   adapter weights is never used). A D that does not serve the adapter named by `model` refuses
   the request at the one door (404), as a mixed instance does;
2. the blocks after D's own prefix-cache hit, the partial last one included, are pulled (a
   binary stream straight from P, or, when P is on this host, read from its shared-memory
   pool: pd/shm.py) and checked on arrival: chain hash against D's own, crc32 of
   the bytes. The first bad block and every block after it are recomputed (counted by reason),
   never imported. With every block in, D computes nothing of the prompt: its first forward
   is the decode of P's token, as a mixed instance's second step is;
3. the request carries the blocks (`external_kv`, imported by the engine at admission) and P's
   first token (`handoff`, appended instead of a sample: usage, `cached_tokens` and logprobs
   are P's, which are a mixed instance's).

P's blocks are acknowledged (DELETE) once the first output exists, that is once the engine has
imported them: if D dies before that, the lease still lets another D pull them again. A pull
that fails leaves D recomputing what is missing, with P's first token still in hand.
"""

from __future__ import annotations

import json
import logging
import mmap
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import httpx
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from strata import tracing
from strata.engine.request import Handoff
from strata.engine.request import Request as EngineRequest
from strata.errors import DeadlineExceededError, KVPayloadError
from strata.protocol.openai import ChatCompletionRequest, CompletionRequest
from strata.protocol.pd import HANDOFF_HEADER, KV_PATH
from strata.server import serving
from strata.server.pd.shm import STAMP
from strata.server.pd.state import PD, pd_of
from strata.server.pd.wire import BlockReader, Handle, checked_copy, checksum_ok, prompt_digest
from strata.server.preamble import client_request
from strata.server.request_io import SSEResponse, unless_cancelled
from strata.server.resume import marks_for
from strata.types import BlockHash, KVPayload

log = logging.getLogger("strata.server.pd")


class HandoffPull:
    """The `prepare` hook of a request that came with a handle (see the module docstring)."""

    def __init__(self, pd: PD, handle: Handle | None) -> None:
        self.pd = pd
        self.handle = handle
        self.outcome = "local"
        self.staged: list[bytearray] = []  # copies read from a pool (pd/shm.py `Staging`)

    async def __call__(self, requests: list[EngineRequest]) -> None:
        handle = self.handle
        if handle is None:
            return
        self.pd.faults.reached("decode_before_pull")
        request = requests[0]
        why_not = await self._why_not_usable(handle, requests)
        if why_not is not None:
            log.info("hand-off %s not used (prefilling here): %s", handle.handle, why_not)
            self.acknowledge()  # its blocks are of no use to anyone
            self.handle = None
            return
        request.handoff = Handoff(handle.token_id, handle.first_logprob, handle.num_cached_tokens)
        wanted, start = self._wanted(request, handle)
        payloads = await self._traced_pull(handle, start, wanted) if wanted else []
        request.external_kv = {**request.external_kv, **dict(zip(wanted, payloads, strict=False))}
        self.outcome = "pulled" if len(payloads) == len(wanted) else "partial"
        self.pd.faults.reached("decode_after_pull")

    async def _why_not_usable(self, handle: Handle, requests: list[EngineRequest]) -> str | None:
        if len(requests) != 1:
            return "the request has more than one prompt or choice"
        request = requests[0]
        namespace = self.pd.instance.engine.engine.cache_config.namespace
        digest = prompt_digest(request.prompt_token_ids, namespace, request.cache_salt,
                               request.lora_digest)
        if (request.num_prompt_tokens, digest) != (handle.num_prompt_tokens,
                                                   handle.prompt_digest):
            return "the handle names another prompt, model version, cache salt or LoRA adapter"
        return await self.pd.peers.check(handle.url, handle.epoch)

    def _wanted(self, request: EngineRequest, handle: Handle) -> tuple[list[BlockHash], int]:
        """The hashes of the blocks to pull, the partial last one included (the engine then
        computes nothing of the prompt), after D's own prefix hit; and the first one's index."""
        core = self.pd.instance.engine.engine
        prompt, salt = request.prompt_token_ids, request.cache_salt
        hashes = core.block_hashes(prompt, salt, request.num_public_tokens, partial=True,
                                   lora_digest=request.lora_digest)  # an adapter's own KV
        end = min(handle.num_blocks, len(hashes))
        num_full = min(len(prompt) // core.cache_config.block_size, end)
        start = core.num_cached_blocks(hashes[:num_full])
        return hashes[start:end], start

    async def _traced_pull(self, handle: Handle, start: int,
                           wanted: list[BlockHash]) -> list[KVPayload]:
        """`_pull` in a `strata.pd.pull` span (tracing on): bytes, blocks, the checks' verdict."""
        if not tracing.is_on():
            return (await self._pull(handle, start, wanted))[0]
        with tracing.span("strata.pd.pull", {"strata.pd.handle": handle.handle,
                                             "strata.pd.peer": handle.instance_id or handle.url,
                                             "strata.pd.first_block": start,
                                             "strata.pd.num_blocks_wanted": len(wanted)}) as opened:
            payloads, verdict = await self._pull(handle, start, wanted)
            tracing.annotate(opened, **{"strata.pd.num_blocks_pulled": len(payloads),
                                        "strata.pd.bytes": sum(len(p) for p in payloads),
                                        "strata.pd.checks": verdict})
        return payloads

    async def _pull(self, handle: Handle, start: int,
                    wanted: list[BlockHash]) -> tuple[list[KVPayload], str]:
        """The checked blocks that arrived, in order (all of `wanted` when nothing failed), and
        why the pull stopped (complete, hash, checksum, truncated, unavailable): from P's
        shared-memory pool where this process can read it (pd/shm.py), else the stream."""
        pd = self.pd
        payloads: list[KVPayload] = []
        began = time.perf_counter()
        reason = await self._pull_shm(handle, start, wanted, payloads)
        transport = "shm"
        if reason is None:
            transport = "http"
            reason = await self._pull_stream(handle, start, wanted, payloads)
        pd.metrics.pulls.labels(transport).inc()
        pd.metrics.pull_s.observe(time.perf_counter() - began)
        pd.metrics.pull_bytes.labels("decode").inc(sum(len(p) for p in payloads))
        if len(payloads) < len(wanted):
            pd.metrics.recomputed.labels(reason).inc(len(wanted) - len(payloads))
        return payloads, reason

    async def _pull_stream(self, handle: Handle, start: int, wanted: list[BlockHash],
                           payloads: list[KVPayload]) -> str:
        """The HTTP pull: the binary stream of blocks (pd/wire.py)."""
        pd = self.pd
        url = f"{handle.url}{KV_PATH}/{handle.handle}?start={start}&count={len(wanted)}"
        reason = "truncated"
        try:
            async with pd.client.stream("GET", url, headers=pd.headers) as response:
                if response.status_code != 200:
                    reason = "unavailable"
                else:
                    reason = await self._read(response.aiter_raw(), wanted, payloads)
        except (httpx.HTTPError, KVPayloadError) as exc:  # KVPayloadError: not a block stream
            log.warning("pull of %s from %s broke: %s", handle.handle, handle.url, exc)
            pd.peers.forget(handle.url)
        return reason

    async def _pull_shm(self, handle: Handle, start: int, wanted: list[BlockHash],
                        payloads: list[KVPayload]) -> str | None:
        """The pull by reference (pd/shm_pull.py): P puts the blocks in its pool and says where,
        a line a batch; None when there is no pool this process can read (P elsewhere, or P's
        pool full or off): the caller pulls the stream."""
        pd = self.pd
        described = pd.peers.shm_of(handle.url)
        if not pd.shm_peers.may_reach(described):
            return None
        url = f"{handle.url}{KV_PATH}/{handle.handle}/shm?start={start}&count={len(wanted)}"
        try:
            async with pd.client.stream("GET", url, headers=pd.headers) as response:
                if response.status_code == 409:  # P's pool cannot take them now
                    return None
                if response.status_code != 200:
                    return "unavailable"
                lines = response.aiter_lines()
                head = json.loads(await anext(lines))
                pool = pd.shm_peers.attach(described)
                if pool is None or not isinstance(head, dict) \
                        or head.get("token") != pd.shm_peers.token_of(described):
                    return None
                async for line in lines:
                    reason = self._read_pool(pool, json.loads(line), wanted, payloads)
                    if reason != "more":
                        return reason
        except httpx.HTTPError as exc:
            log.warning("pull of %s from %s broke: %s", handle.handle, handle.url, exc)
            pd.peers.forget(handle.url)
        except (ValueError, TypeError, StopAsyncIteration):  # not a manifest
            return "unavailable"
        return "complete" if len(payloads) == len(wanted) else "truncated"

    def _read_pool(self, pool: mmap.mmap, blocks: object, wanted: list[BlockHash],
                   payloads: list[KVPayload]) -> str:
        """Reads one manifest line's blocks out of `pool` into `payloads`, checked as streamed
        ones are; "more" while every one was good and more are wanted, else why it stopped."""
        if not isinstance(blocks, list):
            return "unavailable"
        for entry in blocks:
            index = len(payloads)
            if index >= len(wanted):
                return "hash"
            try:
                hash_hex, offset, length = entry
                block_hash = BlockHash(bytes.fromhex(hash_hex))
            except (ValueError, TypeError):
                return "unavailable"
            if type(offset) is not int or type(length) is not int \
                    or not STAMP <= offset <= offset + length <= len(pool):
                return "unavailable"
            if block_hash != wanted[index]:
                return "hash"
            payload = self.pd.staging.get(length)  # a copy: what is checked is imported
            with memoryview(pool)[offset: offset + length] as slot:
                is_intact = checked_copy(slot, payload)
            if not is_intact:
                self.pd.staging.give_back([payload])
                return "checksum"
            if pool[offset - STAMP: offset - STAMP + len(block_hash)] != block_hash:
                self.pd.staging.give_back([payload])  # P let the slot go meanwhile: not ours
                return "unavailable"
            self.staged.append(payload)
            payloads.append(payload)
            if index == 0:
                self.pd.faults.reached("decode_during_pull")
        return "complete" if len(payloads) == len(wanted) else "more"

    async def _read(self, chunks: AsyncIterator[bytes], wanted: list[BlockHash],
                    payloads: list[KVPayload]) -> str:
        """Reads blocks into `payloads` until done or the first bad one; why it stopped."""
        reader = BlockReader()
        async for chunk in chunks:
            for block_hash, payload in reader.feed(chunk):
                index = len(payloads)
                if index >= len(wanted) or block_hash != wanted[index]:
                    return "hash"
                if not checksum_ok(payload):
                    return "checksum"
                payloads.append(payload)
                if index == 0:
                    self.pd.faults.reached("decode_during_pull")
            if len(payloads) == len(wanted):
                return "complete"
        return "truncated"

    def acknowledge(self, *, imported: bool = True) -> None:
        """P may free the blocks (in the background; a P that is gone lets its lease end).
        `imported`: the engine has imported them, so their copies may serve the next pull (a
        cancelled request's may still be read: they are left to the collector)."""
        handle, pd = self.handle, self.pd
        if imported:
            pd.staging.give_back(self.staged)
        self.staged = []
        if handle is None:
            return

        async def delete() -> None:
            try:
                await pd.client.delete(f"{handle.url}{KV_PATH}/{handle.handle}",
                                       headers=pd.headers)
            except httpx.HTTPError as exc:
                log.info("acknowledging %s failed (its lease will end): %s", handle.handle, exc)

        pd.spawn(delete())


async def handle_of(request: Request) -> Handle | None:
    """The request's handle, admitted by this instance's trust (pd/trust.py): a forged one is
    a 400 before anything is contacted."""
    header = request.headers.get(HANDOFF_HEADER)
    return await pd_of(request).trust.admit(header) if header else None


async def decode_chat(request: Request) -> Response:
    """POST /internal/decode/v1/chat/completions"""
    return await _decode(request, ChatCompletionRequest, serving.start_chat,
                         serving.chat_stream, serving.chat_response)


async def decode_completion(request: Request) -> Response:
    """POST /internal/decode/v1/completions"""
    return await _decode(request, CompletionRequest, serving.start_completion,
                         serving.completion_stream, serving.completion_response)


Start = Callable[..., Awaitable[serving.Started]]


async def _decode(request: Request, model: type[ChatCompletionRequest] | type[CompletionRequest],
                  start: Start, stream: Callable[..., AsyncGenerator[bytes, None]],
                  respond: Callable[..., Awaitable[BaseModel]]) -> Response:
    instance, req = await client_request(request, model, task="generate")
    pd = pd_of(request)
    hook = HandoffPull(pd, await handle_of(request))
    ctx = instance.serving
    try:
        started = await unless_cancelled(request, start(ctx, req, hook))
    except (ClientDisconnect, DeadlineExceededError):
        hook.acknowledge(imported=False)  # cancelled: P's blocks are no one's any more
        raise
    hook.acknowledge()  # the engine has imported the blocks: its first output exists
    pd.metrics.handoffs.labels("decode", hook.outcome).inc()
    with_lps = _with_logprobs(req)
    if req.stream:
        frames = _killed_after_first(pd, stream(ctx, started, with_lps, req.include_usage,
                                                marks_for(request, ctx, started)))
        return SSEResponse(request, frames, started.generation.close)
    pd.faults.reached("decode_mid_stream")
    body = await unless_cancelled(request, respond(ctx, started, with_lps))
    return JSONResponse(body.model_dump())


def _with_logprobs(req: ChatCompletionRequest | CompletionRequest) -> bool:
    if isinstance(req, ChatCompletionRequest):
        return bool(req.logprobs)
    return req.logprobs is not None


async def _killed_after_first(pd: PD, frames: AsyncGenerator[bytes, None]
                              ) -> AsyncGenerator[bytes, None]:
    """The frames; the `decode_mid_stream` kill point is after the first one went out."""
    is_first = True
    try:
        async for frame in frames:
            yield frame
            if is_first:
                is_first = False
                pd.faults.reached("decode_mid_stream")
    finally:
        await frames.aclose()


__all__ = ["HandoffPull", "decode_chat", "decode_completion", "handle_of"]
