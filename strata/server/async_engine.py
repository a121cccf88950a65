"""The engine loop off the event loop.

One background thread owns the `Engine`: it alone calls add / abort / step (the engine is not
thread-safe). Coroutines hand it commands through a thread-safe queue and receive outputs on a
per-request `asyncio.Queue`, fed with `loop.call_soon_threadsafe`. When there is no work the
thread sleeps on an Event; every command sets it.

The executor has one driver, this thread: it runs every step, and between two steps the reads
of KV that others ask for (`export_held`, a hand-off's pull: an awaitable answered by the
engine thread) and the imports (fetched or pulled KV, imported by the engine when it admits the
request); so are LoRA adapters loaded and retired at run time (`add_lora`, `retire_lora`), in
order with the requests around them. A parallel executor's ranks take their commands in one
order from one thread, which is what keeps their collectives matched.

Failures. A request whose sequence the executor cannot run fails alone inside `step()`
(strata/engine/isolation.py: finish_reason "error", the others go on). If `step()` itself raises
(the executor can run nothing, or an invariant broke), every in-flight
request ends with finish_reason "error", the engine is marked dead (`is_healthy` turns false, new
requests raise `EngineDeadError`), the error is logged and the death hooks run (`on_death`:
`strata serve` exits non-zero so that its launcher restarts it).
`kill(exc)` makes the engine thread die of `exc` as if a step raised it (a parallel executor's
watcher calls it when a rank exits while the engine is idle).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from strata.engine.config import CacheConfig
from strata.engine.outputs import EngineStats, RequestOutput
from strata.engine.request import FinishReason, Request
from strata.errors import EngineDeadError
from strata.types import BlockHash, RequestId

logger = logging.getLogger("strata.server")


class EngineCore(Protocol):
    """What AsyncEngine (and KV offload) need of `strata.engine.engine.Engine`. Only
    `validate_request`, `block_hashes` and `num_cached_blocks` are called off the engine thread."""

    cache_config: CacheConfig
    vocab_size: int | None  # the ids the model can generate (None: unchecked)

    def block_hashes(self, token_ids: list[int], cache_salt: str = "",
                     num_public_tokens: int = 0, *, partial: bool = False,
                     lora_digest: str = "") -> list[BlockHash]: ...

    def num_cached_blocks(self, hashes: list[BlockHash]) -> int: ...

    def validate_request(self, request: Request) -> None: ...

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: RequestId) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def release_held(self, request_id: RequestId) -> int: ...

    def export_held(self, request_id: RequestId, block_ids: list[int]) -> list[bytes]: ...

    def export_held_into(self, request_id: RequestId, block_ids: list[int],
                         buffers: list[memoryview]) -> list[int]: ...

    def add_lora(self, adapter: Any) -> str: ...

    def retire_lora(self, digest: str) -> None: ...


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass(slots=True)
class _Call:
    """Work for the engine thread between two steps, answered to a coroutine. When `is_fatal`,
    its failure is the engine's (a read of its own held KV); else the caller's news."""

    fn: Callable[[EngineCore], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    is_fatal: bool = False

    def answer(self, result: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self._settle, result)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _settle(self, result: Any) -> None:
        if self.future.done():  # the caller left (its pull was cancelled)
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


_Command = tuple[str, Request | RequestId | Exception | _Call | None]


class AsyncEngine:
    """Serves one `Engine` to asyncio code. Call `start()` once (create_app's lifespan does)."""

    def __init__(self, engine: EngineCore, *, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[RequestId, _Stream] = {}
        self._lock = threading.Lock()
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self._death_hooks: list[Callable[[str], None]] = []
        self._is_closed = False  # the engine thread left: no command is read any more

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
            self._thread.start()

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs and has not died."""
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    async def shutdown(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for in-flight requests, abort the rest, stop the thread."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_in_flight and loop.time() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        with self._lock:
            leftover = list(self._streams)
        for request_id in leftover:
            self._post(("abort", request_id))
        self._stopping = True
        self._post(("stop", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(timeout_s, 1.0))

    def kill(self, exc: Exception) -> None:
        """Make the engine thread die of `exc` (thread-safe)."""
        self._post(("fail", exc))

    def on_death(self, hook: Callable[[str], None]) -> None:
        """Call `hook(reason)` on the engine thread once the engine has died, after every stream
        got its final "error" output."""
        self._death_hooks.append(hook)

    def stats(self) -> EngineStats:
        """The snapshot taken by the engine thread after its last step or command."""
        return self._stats

    # --- requests -----------------------------------------------------------------------------

    def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of `request` until it finishes. Closing the iterator early aborts it.

        Validation errors raise here, synchronously, before anything is queued; a refusal by the
        engine thread (e.g. the waiting queue filled up meanwhile) raises at the first iteration.
        The request is queued at the first iteration.
        """
        self._check_alive()
        self.engine.validate_request(request)
        return self._outputs(request)

    async def _outputs(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[request.request_id] = stream
        if self.dead_reason is not None:  # died between generate() and now: _die missed us
            with self._lock:
                self._streams.pop(request.request_id, None)
            raise EngineDeadError(self.dead_reason)
        self._post(("add", request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self._post(("abort", request.request_id))

    def release_held(self, request_id: RequestId) -> None:
        """Return the blocks a finished request left held to the free pool (on the engine
        thread, at its next command pass)."""
        self._post(("release", request_id))

    async def export_held(self, request_id: RequestId, block_ids: list[int]) -> list[bytes]:
        """The KV payloads of blocks the finished `request_id` holds (`Engine.export_held`),
        read by the engine thread between two steps. Raises EngineDeadError when the engine
        died or stopped before it read them."""
        return await self._call(lambda e: e.export_held(request_id, list(block_ids)),
                                is_fatal=True)

    async def export_held_into(self, request_id: RequestId, block_ids: list[int],
                               buffers: list[memoryview]) -> list[int]:
        """`export_held` written into `buffers` by the engine thread (`Engine.export_held_into`):
        the payloads' lengths. Raises EngineDeadError as `export_held` does."""
        return await self._call(lambda e: e.export_held_into(request_id, list(block_ids),
                                                             buffers), is_fatal=True)

    async def add_lora(self, adapter: Any) -> str:
        """Serve a LoRA adapter (strata.model.lora.LoraAdapter, loaded off the event loop):
        added by the engine thread between two steps; its digest. A request posted after this
        returns may name it."""
        digest: str = await self._call(lambda e: e.add_lora(adapter))
        return digest

    async def retire_lora(self, digest: str) -> None:
        """No name serves `digest` any more (`Engine.retire_lora`). Commands run in order: a
        request posted before this finishes on the adapter, one posted after is refused."""
        await self._call(lambda e: e.retire_lora(digest))

    async def _call(self, fn: Callable[[EngineCore], Any], *, is_fatal: bool = False) -> Any:
        self._check_alive()
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop, loop.create_future(), is_fatal=is_fatal)
        with self._lock:  # posted before the thread closes, or refused: never left unanswered
            if self._is_closed:
                raise EngineDeadError(self.dead_reason or "the engine thread is not running")
            self._post(("call", call))
        return await call.future

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._stopping or not self.is_healthy:
            raise EngineDeadError("the engine thread is not running")

    def _post(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._dispatch(self.engine.step())
                self._stats = self.engine.stats()
        except Exception as exc:
            self._die(exc)
        finally:
            self._close()

    def _apply_commands(self) -> None:
        applied = False
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            applied = True
            if kind == "stop":
                self._stopping = True
            elif kind == "abort":
                self.engine.abort_request(RequestId(str(arg)))
            elif kind == "release":
                self.engine.release_held(RequestId(str(arg)))
            elif kind == "fail" and isinstance(arg, Exception):
                raise arg
            elif isinstance(arg, _Call):
                self._run_call(arg)
            elif isinstance(arg, Request):
                self._add(arg)
        if applied:
            self._stats = self.engine.stats()

    def _run_call(self, call: _Call) -> None:
        """A fatal call's failure kills the engine (the caller gets EngineDeadError)."""
        try:
            result = call.fn(self.engine)
        except Exception as exc:
            if call.is_fatal:
                call.answer(EngineDeadError(f"{type(exc).__name__}: {exc}"))
                raise
            call.answer(exc)
            return
        call.answer(result)

    def _close(self) -> None:
        """The thread leaves: answer the reads still queued (the other commands no longer
        matter) and refuse new ones."""
        with self._lock:
            self._is_closed = True
        reason = self.dead_reason or "the engine thread stopped"
        while True:
            try:
                _, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(arg, _Call):
                arg.answer(EngineDeadError(reason))

    def _add(self, request: Request) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # a refusal is the caller's news, not the loop's death
            stream = self._stream(request.request_id)
            if stream is not None:
                stream.put(exc)

    def _stream(self, request_id: RequestId) -> _Stream | None:
        with self._lock:
            return self._streams.get(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._stream(output.request_id)
            if stream is not None:
                stream.put(output)
            elif not output.finished or output.held is not None:
                self.engine.abort_request(output.request_id)  # its consumer left: nobody
                # reads it, nobody leases what it holds

    def _die(self, exc: Exception) -> None:
        logger.error("engine step failed; the engine is dead", exc_info=exc)
        self.dead_reason = f"{type(exc).__name__}: {exc}"
        with self._lock:
            streams = dict(self._streams)
        for request_id, stream in streams.items():
            stream.put(RequestOutput(request_id=request_id, new_token_ids=[], new_text="",
                                     finished=True, finish_reason=FinishReason.ERROR))
        for hook in self._death_hooks:
            hook(self.dead_reason)


__all__ = ["AsyncEngine", "EngineCore"]
