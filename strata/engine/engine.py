"""The engine: schedule -> execute -> update -> outputs, one step at a time.

Not thread-safe: one thread owns it (the server runs it off the event loop). Only
`validate_request`, `block_hashes`, `num_cached_blocks` and `export_blocks` (of held blocks) may
be called from other threads.

KV offload stays I/O-free here: a request may arrive with fetched KV payloads
(`Request.external_kv`), imported by the executor when the request is admitted, and a request
with `kv_export` leaves with the payloads of its full blocks on its final output; the server
does the fetching and publishing.

Prefill/decode hand-off stays I/O-free too: a request with `hold_blocks` leaves its full
computed blocks held when it finishes (its final output says which, `RequestOutput.held`) until
`release_held`; held blocks are never written, so `export_blocks` may read them from any thread.
A request with a `handoff` gets the prefill instance's first token instead of its own sample.
"""

from __future__ import annotations

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.detokenizer import IncrementalDetokenizer, check_stop
from strata.engine.executor import (
    KVTransfer,
    ModelExecutor,
    ModelInput,
    ModelOutput,
    SampledToken,
    ScheduledSequence,
    TokenDecoder,
)
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.outputs import EngineStats, HeldBlocks, RequestOutput
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
    ) -> None:
        self.executor = executor
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.decoder = decoder
        self.vocab_size = vocab_size
        self.kv = KVCacheManager(cache_config)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        executor.allocate_kv_cache(cache_config.num_blocks, cache_config.block_size)

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
        return self.scheduler.has_unfinished()

    def block_hashes(self, token_ids: list[int], cache_salt: str = "", *,
                     partial: bool = False) -> list[BlockHash]:
        """The identities of the full blocks of `token_ids` (model, version and salt included),
        with `partial` also of the partial last block (a hand-off moves it); safe from any
        thread."""
        return self.kv.hash_tokens(token_ids, cache_salt, partial=partial)

    def num_cached_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` the prefix cache holds: a hint, safe from any
        thread (it may change before the request is admitted)."""
        return self.kv.num_cached_blocks(hashes)

    def release_held(self, request_id: RequestId) -> int:
        """Return the blocks a finished request left held to the free pool; how many."""
        return self.kv.release_held(request_id)

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The KV payloads of `block_ids` (empty when the executor cannot export). Safe from
        any thread for held blocks: nothing writes a block while it is held."""
        if not isinstance(self.executor, KVTransfer):
            return []
        return self.executor.export_blocks(block_ids)

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        for kv_import in scheduled.kv_imports:
            self.scheduler.on_kv_imported(scheduled, kv_import, self._import_kv(kv_import))
        outputs = self._hand_over(scheduled.handed)
        if scheduled.is_empty:
            return outputs
        model_output = self.executor.execute(self._model_input(scheduled))
        return outputs + self._update(scheduled, model_output)

    def _hand_over(self, handed: list[Request]) -> list[RequestOutput]:
        """Append the first token a prefill instance sampled to each request whose whole prompt
        was imported (a refused import left it tokens to compute: it samples, see `_update`)."""
        return [self._append_token(request, request.handoff.token_id, request.handoff.logprob)
                for request in handed
                if request.handoff is not None and request.num_tokens_to_compute == 0]

    def _import_kv(self, kv_import: KVImport) -> int:
        """Write fetched KV into its blocks; how many leading payloads the executor took."""
        if not isinstance(self.executor, KVTransfer):
            return 0
        return self.executor.import_blocks(kv_import.block_ids, kv_import.payloads)

    def _model_input(self, scheduled: SchedulerOutput) -> ModelInput:
        sequences = []
        for request, num_new in scheduled.scheduled:
            start = request.num_computed_tokens
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

    def _update(self, scheduled: SchedulerOutput, model_output: ModelOutput) -> list[RequestOutput]:
        outputs = []
        for request, num_new in scheduled.scheduled:
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += num_new
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)
            sampled = model_output.get(request.request_id)
            if sampled is not None and request.handoff is not None \
                    and request.num_output_tokens == 0:
                handoff = request.handoff  # the prefill instance's token: never re-sampled
                sampled = SampledToken(handoff.token_id, handoff.logprob)
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
        held: HeldBlocks | None = None
        if status is not None:
            if request.kv_export:
                kv_blocks = self._export_kv(request)
            if request.hold_blocks:
                held = self.kv.hold(request)
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
            num_held_blocks=self.kv.num_held_blocks,
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.scheduler.running:
            if request.status != RequestStatus.RUNNING:
                raise RuntimeError(f"running_are_running: {request.request_id} is {request.status}")
