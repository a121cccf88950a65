"""The engine: schedule -> execute -> update -> outputs, one step at a time.

With an `AsyncModelExecutor` (pipeline parallel) a step keeps up to `max_concurrent_batches`
batches in flight: it schedules and submits while the executor has room and some request can
run, then waits for the oldest batch and returns its outputs, so each step returns one batch's
news. A plain `ModelExecutor` is the same loop with one batch.

Not thread-safe: one thread owns it (the server runs it off the event loop). Only
`validate_request`, `block_hashes` and `num_cached_blocks` may be called from other threads.

KV offload stays I/O-free here: a request may arrive with fetched KV payloads
(`Request.external_kv`), imported by the executor when the request is admitted, and a request
with `kv_export` leaves with the payloads of its full blocks on its final output; the server
does the fetching and publishing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from strata.engine.batch_queue import BatchQueue
from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.detokenizer import IncrementalDetokenizer, check_stop
from strata.engine.executor import (
    KVTransfer,
    ModelExecutor,
    ModelInput,
    ModelOutput,
    ScheduledSequence,
    TokenDecoder,
)
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.outputs import EngineStats, RequestOutput
from strata.engine.request import Logprob, Request, RequestStatus
from strata.engine.scheduler import KVImport, Scheduler, SchedulerOutput
from strata.errors import ContextLengthError, InvalidRequestError, OverloadedError
from strata.types import BlockHash, RequestId


class Engine:
    def __init__(
        self,
        executor: ModelExecutor,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        decoder: TokenDecoder,
        *,
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.executor = executor
        self.clock = clock  # times steps for the adaptive prefill budget
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.decoder = decoder
        self.vocab_size = vocab_size
        executor.allocate_kv_cache(cache_config.num_blocks, cache_config.block_size)
        self.kv = KVCacheManager(cache_config)
        self._batches = BatchQueue(executor)
        self.scheduler = Scheduler(scheduler_config, self.kv,
                                   max_concurrent_batches=self._batches.max_batches)
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def validate_request(self, request: Request) -> None:
        """Refuse what can never run; safe from any thread."""
        num_prompt = request.num_prompt_tokens
        max_len = self.scheduler_config.max_model_len
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if self.vocab_size is not None and not all(
            0 <= t < self.vocab_size for t in request.prompt_token_ids
        ):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
            )
        if num_prompt >= max_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_len} tokens, but the prompt has "
                f"{num_prompt} tokens (leave room for at least one generated token)",
                param="messages",
            )
        if num_prompt + request.sampling_params.max_tokens > max_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_len} tokens; the prompt has "
                f"{num_prompt} tokens and max_tokens is {request.sampling_params.max_tokens} "
                f"({num_prompt + request.sampling_params.max_tokens} in total). Lower max_tokens "
                "or shorten the prompt.",
                param="max_tokens",
            )
        num_blocks_needed = -(-(num_prompt + 1) // self.cache_config.block_size)
        if num_blocks_needed > self.cache_config.num_blocks:
            raise ContextLengthError(
                f"the prompt needs {num_blocks_needed} KV blocks but the cache holds only "
                f"{self.cache_config.num_blocks}; raise --kv-cache-gb",
                param="prompt",
            )
        if self.scheduler.num_waiting >= self.scheduler_config.max_waiting:
            raise OverloadedError(
                f"the waiting queue is full ({self.scheduler_config.max_waiting} requests)"
            )

    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        request.status = RequestStatus.WAITING
        self.scheduler.add(request)
        self._detok[request.request_id] = IncrementalDetokenizer(self.decoder, request)

    def abort_request(self, request_id: RequestId) -> None:
        request = self.scheduler.get(request_id)
        if request is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._detok.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a batch is in flight (`step` collects it)."""
        return self.scheduler.has_unfinished() or len(self._batches) > 0

    def block_hashes(self, token_ids: list[int], cache_salt: str = "",
                     num_public_tokens: int = 0) -> list[BlockHash]:
        """The identities of the full blocks of `token_ids` (model, version and salt included;
        see `Request.num_public_tokens`); safe from any thread."""
        return self.kv.hash_tokens(token_ids, cache_salt, num_public_tokens)

    def num_cached_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` the prefix cache holds: a hint, safe from any
        thread (it may change before the request is admitted)."""
        return self.kv.num_cached_blocks(hashes)

    def step(self) -> list[RequestOutput]:
        """Submit batches while the executor has room and a request can run, then wait for the
        oldest batch in flight and return its news ([] when none was in flight)."""
        started = self.clock()
        while self._batches.has_room and self._submit_next():
            pass
        collected = self._batches.collect_oldest()
        if collected is None:
            return []
        if self._batches.max_batches == 1:  # the step's time is this batch's
            sizes = [n for _, n in collected.scheduled.scheduled]
            self.scheduler.step_budget.observe(sizes.count(1), sum(n for n in sizes if n > 1),
                                               self.clock() - started)
        applied = self.scheduler.on_collected(collected.scheduled)
        failed = [self._fail(r) for r, _ in applied if r.request_id in collected.failed]
        return failed + self._update([(r, n) for r, n in applied
                                     if r.status == RequestStatus.RUNNING],
                                     collected.output)

    def _submit_next(self) -> bool:
        """Schedule a batch and submit it; False when no request can run now."""
        scheduled = self.scheduler.schedule()
        for kv_import in scheduled.kv_imports:
            self.scheduler.on_kv_imported(scheduled, kv_import, self._import_kv(kv_import))
        if scheduled.is_empty:
            return False
        model_input = self._model_input(scheduled)
        self.scheduler.on_submitted(scheduled)
        self._batches.submit(scheduled, model_input)
        return True

    def _import_kv(self, kv_import: KVImport) -> int:
        """Write fetched KV into its blocks; how many leading payloads the executor took."""
        if not isinstance(self.executor, KVTransfer):
            return 0
        return self.executor.import_blocks(kv_import.block_ids, kv_import.payloads)

    def _model_input(self, scheduled: SchedulerOutput) -> ModelInput:
        sequences = []
        for request, num_new in scheduled.scheduled:
            start = request.num_computed_tokens + request.num_in_flight_tokens
            sequences.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    start_pos=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    needs_sample=start + num_new == request.num_tokens,
                    sampling_params=request.sampling_params,
                    output_token_ids=request.output_token_ids,
                    prompt_token_ids=request.prompt_token_ids,
                )
            )
        return ModelInput(sequences, self.cache_config.block_size)

    def _update(
        self, scheduled: list[tuple[Request, int]], model_output: ModelOutput
    ) -> list[RequestOutput]:
        outputs = []
        for request, num_new in scheduled:
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += num_new
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)
            sampled = model_output.get(request.request_id)
            if sampled is not None:
                outputs.append(self._append_token(request, sampled.token_id, sampled.logprob))
        return outputs

    def _append_token(
        self, request: Request, token_id: int, logprob: Logprob | None
    ) -> RequestOutput:
        request.output_token_ids.append(token_id)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        self.num_generated_tokens += 1
        detok = self._detok[request.request_id]
        status = self._finish_status(request, token_id, detok)
        kv_blocks: list[tuple[BlockHash, bytes]] = []
        if status is not None:
            if request.kv_export:
                kv_blocks = self._export_kv(request)
            self.scheduler.finish(request, status)
            del self._detok[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_text=detok.take_new_text(finished=status is not None),
            new_logprobs=[logprob] if logprob is not None else [],
            finished=status is not None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            kv_blocks=kv_blocks,
        )

    def _fail(self, request: Request) -> RequestOutput:
        """The executor failed on this request alone (isolation.py): it ends with "error"."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self._detok.pop(request.request_id, None)
        return RequestOutput(request_id=request.request_id, new_token_ids=[], new_text="",
                             finished=True, finish_reason=request.finish_reason,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens,
                             num_output_tokens=request.num_output_tokens)

    def _export_kv(self, request: Request) -> list[tuple[BlockHash, bytes]]:
        """(hash, payload) of the request's computed full blocks not known to be stored."""
        hashes = self.kv.computed_block_hashes(request)[request.kv_export_start_block :]
        if not hashes or not isinstance(self.executor, KVTransfer):
            return []
        first = request.kv_export_start_block
        block_ids = self.kv.block_ids(request.request_id)[first : first + len(hashes)]
        return list(zip(hashes, self.executor.export_blocks(block_ids), strict=True))

    def _finish_status(
        self, request: Request, token_id: int, detok: IncrementalDetokenizer
    ) -> RequestStatus | None:
        """Token stops first (their text is never shown), then stop strings, then length."""
        status = check_stop(request, token_id, self.scheduler_config.max_model_len)
        if status == RequestStatus.FINISHED_STOPPED:
            return status
        if detok.add_token(token_id) is not None:
            request.stop_reason = detok.matched_stop
            return RequestStatus.FINISHED_STOPPED
        if status is not None:
            detok.flush()
        return status

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.num_queried_tokens,
            prefix_cache_hits=self.kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_external_hit_tokens=self.kv.num_external_hit_tokens,
            num_kv_import_failures=self.scheduler.num_kv_import_failures,
            num_batches_in_flight=len(self._batches),
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def check_integrity(self) -> None:
        in_flight = list(self._batches.in_flight())
        self.kv.check_integrity(held=[b for out in in_flight for b in out.held_blocks])
        self.scheduler.check_integrity(in_flight)
