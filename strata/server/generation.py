"""The n engine requests behind one HTTP request, and what each choice has produced so far.

`start` queues every request and waits for the first output of each, so a refusal (queue full,
engine dead) is raised before any response byte is sent. Closing the merged stream (client gone)
aborts every unfinished request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from strata.clock import Clock
from strata.engine.outputs import RequestOutput
from strata.engine.request import Logprob, Request
from strata.protocol.openai import PromptTokensDetails, UsageInfo
from strata.server.async_engine import AsyncEngine
from strata.server.kv_offload import KVOffload, publishing
from strata.server.metrics import ServerMetrics, track
from strata.server.phase_spans import traced
from strata.tracing import is_on

Outputs = AsyncGenerator[RequestOutput, None]
Prepare = Callable[[list[Request]], Awaitable[None]]


@dataclass(slots=True)
class ChoiceState:
    """Accumulated news of one choice (one engine request)."""

    index: int
    prompt_index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def update(self, output: RequestOutput) -> None:
        self.text_parts.append(output.new_text)
        self.logprobs.extend(output.new_logprobs)
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        self.num_output_tokens = output.num_output_tokens
        if output.finished:
            self.finish_reason = output.finish_reason.value if output.finish_reason else None
            self.stop_reason = output.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(choices: list[ChoiceState]) -> UsageInfo:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI does."""
    first_of_prompt: dict[int, ChoiceState] = {}
    for choice in choices:
        first_of_prompt.setdefault(choice.prompt_index, choice)
    prompt = sum(c.num_prompt_tokens for c in first_of_prompt.values())
    cached = sum(c.num_cached_tokens for c in first_of_prompt.values())
    completion = sum(c.num_output_tokens for c in choices)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


@dataclass(slots=True)
class Generation:
    """Started engine requests: the first output of each has arrived."""

    choices: list[ChoiceState]
    firsts: list[RequestOutput]
    streams: list[Outputs]

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(choice index, output) in arrival order until every choice has finished."""
        for i, first in enumerate(self.firsts):
            yield i, first
        live = [i for i, first in enumerate(self.firsts) if not first.finished]
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, self.streams[i], queue)) for i in live]
        try:
            remaining = len(live)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
                yield i, item
        finally:
            await self.close(tasks)

    async def close(self, tasks: list[asyncio.Task[None]] | None = None) -> None:
        """Abort what is unfinished. Cancelling first is synchronous, so it happens even if
        this coroutine is itself cancelled while it waits."""
        for task in tasks or []:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*(tasks or []), return_exceptions=True)
            for stream in self.streams:
                await stream.aclose()


async def _pump(index: int, stream: Outputs,
                queue: asyncio.Queue[tuple[int, RequestOutput | Exception]]) -> None:
    try:
        async for output in stream:
            queue.put_nowait((index, output))
    except Exception as exc:
        queue.put_nowait((index, exc))


async def start(engine: AsyncEngine, requests: list[Request], prompt_indices: list[int],
                metrics: ServerMetrics, clock: Clock,
                kv_offload: KVOffload | None = None, prepare: Prepare | None = None
                ) -> Generation:
    """Queue `requests` (validated synchronously by the engine) and await their first outputs.
    With `kv_offload`, missing prefixes are fetched first and finished KV is published;
    `prepare` (a prefill/decode hand-off) sees the validated requests last before the engine."""
    if kv_offload is not None or prepare is not None:
        for request in requests:
            engine.engine.validate_request(request)  # nothing is fetched for a refused request
    if kv_offload is not None:
        await kv_offload.prepare(requests)
    if prepare is not None:
        await prepare(requests)
    streams: list[Outputs] = []
    for request in requests:
        outputs = engine.generate(request)
        if is_on():  # its phases become spans (phase_spans.py)
            outputs = traced(request, outputs)
        stream = track(outputs, metrics, request.arrival_time, clock)
        streams.append(publishing(stream, kv_offload) if kv_offload is not None else stream)
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    choices = [ChoiceState(i, p) for i, p in enumerate(prompt_indices)]
    generation = Generation(choices, [], streams)
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        await generation.close()
        raise errors[0]
    generation.firsts = [f for f in firsts if isinstance(f, RequestOutput)]
    return generation


__all__ = ["ChoiceState", "Generation", "Prepare", "start", "usage"]
