"""The engine: schedule -> execute -> update -> outputs, one step at a time.

With an `AsyncModelExecutor` (pipeline parallel) a step keeps up to `max_concurrent_batches`
batches in flight: it schedules and submits while the executor has room and some request can
run, then waits for the oldest batch and returns its outputs, so each step returns one batch's
news. A plain `ModelExecutor` is the same loop with one batch.

Not thread-safe: one thread owns it (the server runs it off the event loop), and through it
the executor: nothing else calls the executor (a parallel executor's ranks take commands from
one driver). Only `validate_request`, `block_hashes` and `num_cached_blocks` may be called from
other threads.

KV offload stays I/O-free here: a request may arrive with fetched KV payloads
(`Request.external_kv`), imported by the executor when the request is admitted, and a request
with `kv_export` leaves with the payloads of its full blocks on its final output; the server
does the fetching and publishing.

So does the prefill/decode hand-off: a request with `hold_blocks` leaves its blocks held when it
finishes (`RequestOutput.held`), readable with `export_held`, until `release_held`; one with a
`handoff` gets the prefill instance's first token instead of a sample and, its whole prompt
imported, computes none of it.
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.engine.batch_queue import BatchQueue
from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.detokenizer import IncrementalDetokenizer, check_stop
from strata.engine.executor import (
    ExportsInto,
    KVTransfer,
    ModelExecutor,
    ModelInput,
    ModelOutput,
    Pooled,
    SampledToken,
    ScheduledSequence,
    TokenDecoder,
)
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.loras import Adapters
from strata.engine.outputs import EngineStats, HeldBlocks, RequestOutput
from strata.engine.request import Logprob, Request, RequestStatus
from strata.engine.scheduler import KVImport, Scheduler, SchedulerOutput
from strata.engine.validation import check_request
from strata.errors import InvalidRequestError
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
        clock: Clock | None = None,
        step_clock: Clock = time.perf_counter,
    ) -> None:
        """`clock`: the clock of `Request.arrival_time`, which aging reads; `step_clock` times
        each step for the adaptive prefill budget (scheduler.step_budget)."""
        self.executor = executor
        self.step_clock = step_clock
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.decoder = decoder
        self.vocab_size = vocab_size
        executor.allocate_kv_cache(cache_config.num_blocks, cache_config.block_size)
        self.kv = KVCacheManager(cache_config)
        self._batches = BatchQueue(executor)
        self.loras = Adapters(executor)
        self.scheduler = Scheduler(scheduler_config, self.kv,
                                   max_concurrent_batches=self._batches.max_batches, clock=clock)
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self._handed: list[RequestOutput] = []  # first tokens handed over, for this step
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def validate_request(self, request: Request) -> None:
        """Refuse what can never run; safe from any thread."""
        check_request(request, self.scheduler_config, self.cache_config, self.vocab_size,
                      num_waiting=self.scheduler.num_waiting)

    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        self.loras.check(request)
        detok = IncrementalDetokenizer(self.decoder, request)
        if detok.matched_stop is not None:
            raise InvalidRequestError("the generated tokens of a resumed request already hold "
                                      "a stop string", param="output_token_ids")
        constraint = request.sampling_params.constraint  # resumed: advance past what was sent
        if constraint is not None and not all(map(constraint.accept, request.output_token_ids)):
            raise InvalidRequestError("the generated tokens of a resumed request break its "
                                      "structured output", param="output_token_ids")
        request.status = RequestStatus.WAITING
        self.scheduler.add(request)
        self._detok[request.request_id] = detok

    def abort_request(self, request_id: RequestId) -> None:
        """End the request and free its blocks; one that already finished holding its blocks
        (a hand-off's prefill whose caller left before the hold was leased) releases them."""
        request = self.scheduler.get(request_id)
        if request is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        else:
            self.kv.release_finished(request_id)
        self._detok.pop(request_id, None)

    def add_lora(self, adapter: object) -> str:
        """Serve a LoRA adapter (the executor's kind, strata.model.lora); its digest."""
        return self.loras.add(adapter)

    def retire_lora(self, digest: str) -> None:
        """No name serves the adapter `digest` any more: requests in flight finish on it, new
        ones are refused, its weights are freed when the last one ends (strata.engine.loras)."""
        self.loras.retire(digest, self.scheduler.lora_digests())

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a batch is in flight (`step` collects it)."""
        return self.scheduler.has_unfinished() or len(self._batches) > 0

    def block_hashes(self, token_ids: list[int], cache_salt: str = "",
                     num_public_tokens: int = 0, *, partial: bool = False,
                     lora_digest: str = "") -> list[BlockHash]:
        """The identities of the full blocks of `token_ids` (model, version, salt and LoRA
        digest included; see `Request.num_public_tokens`), with `partial` the partial last
        one's; any thread."""
        return self.kv.hash_tokens(token_ids, cache_salt, num_public_tokens, partial=partial,
                                   lora_digest=lora_digest)

    def num_cached_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` the prefix cache holds: a hint, safe from any
        thread (it may change before the request is admitted)."""
        return self.kv.num_cached_blocks(hashes)

    def release_held(self, request_id: RequestId) -> int:
        """Return the blocks a finished request left held to the free pool; how many."""
        return self.kv.release_finished(request_id)

    def export_held(self, request_id: RequestId, block_ids: list[int]) -> list[bytes]:
        """The KV payloads of `block_ids`, in order, while the finished `request_id` holds every
        one of them (a held block is never written, so any moment between steps reads the same
        bytes); [] once the hold is released or when the executor cannot export."""
        if not self._may_export(request_id, block_ids):
            return []
        assert isinstance(self.executor, KVTransfer)
        return self.executor.export_blocks(block_ids)

    def export_held_into(self, request_id: RequestId, block_ids: list[int],
                         buffers: list[memoryview]) -> list[int]:
        """`export_held` written into `buffers` (one per block, each large enough for a
        payload): the payloads' lengths, [] as `export_held` answers []."""
        if isinstance(self.executor, ExportsInto) and self._may_export(request_id, block_ids):
            try:
                return self.executor.export_blocks_into(block_ids, buffers)
            except ValueError:  # a buffer its owner released (a cancelled pull at shutdown)
                return []
        lengths = []
        for payload, out in zip(self.export_held(request_id, block_ids), buffers, strict=False):
            if len(payload) > out.nbytes:
                return []
            out[: len(payload)] = payload
            lengths.append(len(payload))
        return lengths

    def _may_export(self, request_id: RequestId, block_ids: list[int]) -> bool:
        """Whether the finished `request_id` holds every one of `block_ids` and the executor
        can export them."""
        held = set(self.kv.held_block_ids(request_id))
        return bool(block_ids) and held.issuperset(block_ids) \
            and isinstance(self.executor, KVTransfer)

    def step(self) -> list[RequestOutput]:
        """Submit batches while the executor has room and a request can run, then wait for the
        oldest batch in flight and return its news, after the first tokens handed over; then
        free the retired LoRA adapters no request uses any more."""
        outputs = self._step()
        if self.loras.num_retired:
            self.loras.free_unused(self.scheduler.lora_digests())
        return outputs

    def _step(self) -> list[RequestOutput]:
        started = self.step_clock()
        while self._batches.has_room and self._submit_next():
            pass
        handed, self._handed = self._handed, []
        collected = self._batches.collect_oldest()
        if collected is None:
            return handed
        if self._batches.max_batches == 1:  # the step's time is this batch's
            sizes = [n for _, n in collected.scheduled.scheduled]
            self.scheduler.step_budget.observe(sizes.count(1), sum(n for n in sizes if n > 1),
                                               self.step_clock() - started)
        applied = self.scheduler.on_collected(collected.scheduled)
        failed = [self._fail(r) for r, _ in applied if r.request_id in collected.failed]
        return handed + failed + self._update([(r, n) for r, n in applied
                                              if r.status == RequestStatus.RUNNING],
                                              collected.output)

    def _submit_next(self) -> bool:
        """Schedule a batch and submit it; False when no request can run now."""
        scheduled = self.scheduler.schedule()
        for kv_import in scheduled.kv_imports:
            self.scheduler.on_kv_imported(scheduled, kv_import, self._import_kv(kv_import))
        self._handed += self._hand_over(scheduled.handed)
        if scheduled.is_empty:
            return False
        model_input = self._model_input(scheduled)
        self.scheduler.on_submitted(scheduled)
        self._batches.submit(scheduled, model_input)
        return True

    def _hand_over(self, handed: list[Request]) -> list[RequestOutput]:
        """P's first token for each request whose whole prompt was imported (see `_update`);
        the imported full blocks join the prefix cache first, as computed ones do after a step
        (a hand-off that asked for one token runs no step, and its next turn still hits)."""
        outputs = []
        for r in handed:
            if r.handoff is not None and r.num_tokens_to_compute == 0:
                self.kv.cache_full_blocks(r)
                outputs.append(self._append_token(r, r.handoff.token_id, r.handoff.logprob))
        return outputs

    def _import_kv(self, kv_import: KVImport) -> int:
        """Write fetched KV into its blocks; how many leading payloads the executor took."""
        timeline = kv_import.request.timeline
        started_ns = timeline.clock_ns() if timeline is not None else 0
        num_imported = 0
        if isinstance(self.executor, KVTransfer):
            num_imported = self.executor.import_blocks(kv_import.block_ids, kv_import.payloads)
        if timeline is not None:
            timeline.kv_imported(started_ns, len(kv_import.payloads), num_imported)
        return num_imported

    def _model_input(self, scheduled: SchedulerOutput) -> ModelInput:
        sequences = []
        for request, num_new in scheduled.scheduled:
            start = request.num_computed_tokens + request.num_in_flight_tokens
            sequences.append(ScheduledSequence.of(request, start, num_new,
                                                  self.kv.block_ids(request.request_id)))
            if request.timeline is not None and _is_prefill(request, num_new):
                request.timeline.chunk_submitted()
        return ModelInput(sequences, self.cache_config.block_size)

    def _update(
        self, scheduled: list[tuple[Request, int]], model_output: ModelOutput
    ) -> list[RequestOutput]:
        outputs = []
        for request, num_new in scheduled:
            if request.timeline is not None and _is_prefill(request, num_new):
                request.timeline.chunk_done(num_new)
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += num_new
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)
            sampled, handoff = model_output.get(request.request_id), request.pending_handoff
            if sampled is not None and handoff is not None:  # P's token: never re-sampled
                sampled = SampledToken(handoff.token_id, handoff.logprob)
            if isinstance(sampled, Pooled):  # a pooling request ends with its embedding
                outputs.append(self._end(request, RequestStatus.FINISHED_STOPPED, sampled))
            elif sampled is not None:
                outputs.append(self._append_token(request, sampled.token_id, sampled.logprob))
        return outputs

    def _append_token(
        self, request: Request, token_id: int, logprob: Logprob | None
    ) -> RequestOutput:
        request.output_token_ids.append(token_id)
        if request.timeline is not None:
            request.timeline.token()
        if logprob is not None:
            request.output_logprobs.append(logprob)
        self.num_generated_tokens += 1
        detok = self._detok[request.request_id]
        status = self._finish_status(request, token_id, detok)
        kv_blocks: list[tuple[BlockHash, bytes]] = []
        held: HeldBlocks | None = None
        if status is not None:
            if request.kv_export:
                kv_blocks = self._export_kv(request)
            held = self.kv.hold_finished(request) if request.hold_blocks else None
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
            num_cached_tokens=request.num_reported_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            kv_blocks=kv_blocks,
            held=held,
        )

    def _fail(self, request: Request) -> RequestOutput:
        """The executor failed on this request alone (isolation.py): it ends with "error"."""
        return self._end(request, RequestStatus.FINISHED_ERROR)

    def _end(self, request: Request, status: RequestStatus,
             pooled: Pooled | None = None) -> RequestOutput:
        """End `request` without a new token: a failure, or a pooling request's embedding."""
        self.scheduler.finish(request, status)
        self._detok.pop(request.request_id, None)
        return RequestOutput(request_id=request.request_id, new_token_ids=[], new_text="",
                             finished=True, finish_reason=request.finish_reason,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens,
                             num_output_tokens=request.num_output_tokens,
                             embedding=pooled.embedding if pooled else None)

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
        """A token the constraint refuses is an error; then token stops (their text is never
        shown), then stop strings, then a completed constraint, then length. Before
        `min_tokens` only length stops."""
        constraint = request.sampling_params.constraint
        if constraint is not None and not constraint.accept(token_id):
            request.stop_reason = "the structured output constraint refused a token"
            return RequestStatus.FINISHED_ERROR
        status = check_stop(request, token_id, self.scheduler_config.max_model_len)
        if status == RequestStatus.FINISHED_STOPPED:
            return status
        early = request.num_output_tokens < request.sampling_params.min_tokens
        if detok.add_token(token_id, match_stops=not early) is not None:
            request.stop_reason = detok.matched_stop
            return RequestStatus.FINISHED_STOPPED
        if constraint is not None and constraint.is_terminated:  # complete: only EOS may follow
            status = RequestStatus.FINISHED_STOPPED
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
            num_priority_preemptions=self.scheduler.num_priority_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_external_hit_tokens=self.kv.num_external_hit_tokens,
            num_kv_import_failures=self.scheduler.num_kv_import_failures,
            num_batches_in_flight=len(self._batches),
            num_held_blocks=self.kv.num_held_blocks,
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def check_integrity(self) -> None:
        in_flight = list(self._batches.in_flight())
        self.kv.check_integrity(held=[b for out in in_flight for b in out.held_blocks])
        self.scheduler.check_integrity(in_flight)


def _is_prefill(request: Request, num_new: int) -> bool:
    """A chunk of the prompt (or of tokens recomputed after a preemption or for a resume), not
    the decode of the last sampled token."""
    return num_new > 1 or request.num_output_tokens == 0
