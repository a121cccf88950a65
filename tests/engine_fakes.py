"""Fakes for engine tests: an executor whose 'KV cache' stores token ids.

The next token is a hash of the whole context *as read back from the paged cache through the
block table*, so any bookkeeping error (a wrong block reused, a slot overwritten, a missing chunk)
changes the tokens produced and fails the comparison with `reference_tokens`.
`PipelineFakeExecutor` is the same model split into pipeline stages with batches in flight;
`KVTransferFake` adds KV export and import (payload = the block's token ids).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import (
    BatchHandle,
    ModelInput,
    ModelOutput,
    SampledToken,
    ScheduledSequence,
)
from strata.engine.request import Logprob, Request, SamplingParams
from strata.types import RequestId

VOCAB = 64
EOS = 63
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ."


def next_token(context: list[int], salt: int = 0) -> int:
    digest = hashlib.blake2b(repr((context, salt)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS unless forced


class FakeExecutor:
    def __init__(self) -> None:
        self.slots: list[int | None] = []
        self.block_size = 0
        self.num_steps = 0
        self.batch_sizes: list[int] = []
        self.num_tokens_per_step: list[int] = []

    def kv_bytes_per_token(self) -> int:
        return 1

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.slots = [None] * (num_blocks * block_size)
        self.block_size = block_size

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.num_steps += 1
        self.batch_sizes.append(len(model_input.sequences))
        self.num_tokens_per_step.append(model_input.num_tokens)
        out: ModelOutput = {}
        for seq in model_input.sequences:
            context = self._write_and_read(self.slots, seq)
            if seq.needs_sample:
                out[seq.request_id] = _sample(seq, context)
        return out

    def kv_stages(self) -> list[list[int | None]]:
        """The slot arrays that make up the KV cache (one per pipeline stage)."""
        return [self.slots]

    def before_kv_import(self, block_ids: list[int]) -> None:
        """Called by `KVTransferFake.import_blocks`; a pipeline checks it is safe."""

    def _write_and_read(self, slots: list[int | None], seq: ScheduledSequence) -> list[int]:
        """Write the sequence's tokens, then read its whole context back through the table."""
        for i, tok in enumerate(seq.token_ids):
            slots[self._slot(seq.block_ids, seq.start_pos + i)] = tok
        end = seq.start_pos + len(seq.token_ids)
        context = [slots[self._slot(seq.block_ids, p)] for p in range(end)]
        assert all(t is not None for t in context), "read an unwritten KV slot"
        return context  # type: ignore[return-value]

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


def _sample(seq: ScheduledSequence, context: list[int]) -> SampledToken:
    tok = next_token(context, _seed_salt(seq.sampling_params, len(seq.output_token_ids)))
    lp = Logprob(tok, -0.5) if seq.sampling_params.logprobs is not None else None
    return SampledToken(tok, lp)


@dataclass
class _Batch:
    handle: BatchHandle
    model_input: ModelInput
    num_stages_done: int = 0
    contexts: dict[RequestId, list[int]] = field(default_factory=dict)  # as stage 0 read them
    output: ModelOutput = field(default_factory=dict)


class PipelineFakeExecutor(FakeExecutor):
    """An `AsyncModelExecutor`: the fake model in `num_stages` pipeline stages, each with its
    own KV (its layers).

    A submitted batch waits for stage 0. At each `tick()`, every batch whose next stage the batch
    ahead of it has left runs that stage: it writes its tokens into the stage's KV and reads its
    context back. After the last stage it samples; every stage must have read the same context.
    `collect` ticks until its batch is done, so a test controls timing by ticking between engine
    steps. `submit` also checks the engine's guarantees: no request is submitted while its
    batch in flight samples, and no block is written by batches of two requests in flight.
    """

    def __init__(self, num_stages: int = 2, max_concurrent_batches: int | None = None) -> None:
        super().__init__()
        self.num_stages = num_stages
        self.max_concurrent_batches = (
            num_stages if max_concurrent_batches is None else max_concurrent_batches
        )
        self.stage_slots: list[list[int | None]] = []
        self.batches: list[list[tuple[str, int, int]]] = []  # (request, start, tokens) each
        self.stage_busy_ticks = [0] * num_stages
        self.num_ticks = 0
        self.max_in_flight = 0
        self._in_flight: list[_Batch] = []  # submitted, not collected; oldest first

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        super().allocate_kv_cache(num_blocks, block_size)
        self.stage_slots = [[None] * (num_blocks * block_size) for _ in range(self.num_stages)]

    def kv_stages(self) -> list[list[int | None]]:
        return self.stage_slots

    def submit(self, model_input: ModelInput) -> BatchHandle:
        self._check_submit(model_input)
        self.num_steps += 1
        self.batch_sizes.append(len(model_input.sequences))
        self.num_tokens_per_step.append(model_input.num_tokens)
        self.batches.append([(s.request_id, s.start_pos, len(s.token_ids))
                             for s in model_input.sequences])
        batch = _Batch(BatchHandle(len(self.batches) - 1), model_input)
        self._in_flight.append(batch)
        self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
        return batch.handle

    def collect(self, handle: BatchHandle) -> ModelOutput:
        batch = self._in_flight[0]
        assert batch.handle == handle, "batches are collected oldest first"
        while batch.num_stages_done < self.num_stages:
            self.tick()
        self._in_flight.pop(0)
        return batch.output

    def execute(self, model_input: ModelInput) -> ModelOutput:
        return self.collect(self.submit(model_input))

    def tick(self) -> None:
        self.num_ticks += 1
        ahead = self.num_stages  # the stages the batch ahead had done before this tick
        for batch in self._in_flight:
            stage = batch.num_stages_done
            if stage < min(ahead, self.num_stages):
                self._run_stage(batch, stage)
            ahead = stage

    def before_kv_import(self, block_ids: list[int]) -> None:
        written = self._written_in_flight()
        for block_id in block_ids:
            assert block_id not in written, f"import into block {block_id}, written in flight"

    def _run_stage(self, batch: _Batch, stage: int) -> None:
        self.stage_busy_ticks[stage] += 1
        for seq in batch.model_input.sequences:
            context = self._write_and_read(self.stage_slots[stage], seq)
            first = batch.contexts.setdefault(seq.request_id, context)
            assert context == first, f"stage {stage} read other KV than stage 0 ({seq.request_id})"
            if stage == self.num_stages - 1 and seq.needs_sample:
                batch.output[seq.request_id] = _sample(seq, context)
        batch.num_stages_done += 1

    def _check_submit(self, model_input: ModelInput) -> None:
        written = self._written_in_flight()
        sampling = {s.request_id for b in self._in_flight for s in b.model_input.sequences
                    if s.needs_sample}
        for seq in model_input.sequences:
            assert seq.request_id not in sampling, f"{seq.request_id} submitted before its token"
            for block_id in self._written_blocks(seq):
                owner = written.get(block_id, seq.request_id)
                assert owner == seq.request_id, f"block {block_id} of {owner} in flight"

    def _written_in_flight(self) -> dict[int, RequestId]:
        return {block_id: seq.request_id for b in self._in_flight
                for seq in b.model_input.sequences for block_id in self._written_blocks(seq)}

    def _written_blocks(self, seq: ScheduledSequence) -> list[int]:
        first, end = seq.start_pos, seq.start_pos + len(seq.token_ids)
        return seq.block_ids[first // self.block_size : -(-end // self.block_size)]


KV_TAG = b"fake-kv:"


class KVTransferFake(FakeExecutor):
    """Exports a block as its token ids (every stage must agree); refuses payloads without
    `KV_TAG`. Mixed in before a fake executor: `class X(KVTransferFake, PipelineFakeExecutor)`."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.imports: list[list[int]] = []
        self.exports: list[list[int]] = []

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        self.exports.append(list(block_ids))
        payloads = []
        for block_id in block_ids:
            first = self._block_tokens(self.kv_stages()[0], block_id)
            assert all(self._block_tokens(s, block_id) == first for s in self.kv_stages())
            payloads.append(KV_TAG + array("q", first).tobytes())  # type: ignore[arg-type]
        return payloads

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> int:
        self.imports.append(list(block_ids))
        self.before_kv_import(block_ids)
        for i, (block_id, payload) in enumerate(zip(block_ids, payloads, strict=True)):
            if not payload.startswith(KV_TAG):
                return i
            tokens = array("q", payload[len(KV_TAG):]).tolist()
            for slots in self.kv_stages():
                slots[block_id * self.block_size : (block_id + 1) * self.block_size] = tokens
        return len(payloads)

    def _block_tokens(self, slots: list[int | None], block_id: int) -> list[int | None]:
        return slots[block_id * self.block_size : (block_id + 1) * self.block_size]


class KVFakeExecutor(KVTransferFake):
    pass


class KVPipelineFakeExecutor(KVTransferFake, PipelineFakeExecutor):
    pass


def _seed_salt(params: SamplingParams, num_generated: int) -> int:
    if params.temperature == 0 or params.seed is None:
        return 0
    return params.seed * 100_003 + num_generated


class FakeDecoder:
    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[t] for t in token_ids if not (skip_special_tokens and t == EOS))


def reference_tokens(prompt: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
    """What a correct engine must produce for a request running alone, greedily."""
    tokens, out = list(prompt), []
    for i in range(max_tokens):
        salt = 0 if seed is None else seed * 100_003 + i
        tok = next_token(tokens, salt)
        out.append(tok)
        tokens.append(tok)
    return out


def make_engine(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    max_waiting: int = 1024,
    namespace: str = "m@1",
    executor: FakeExecutor | None = None,
    max_queue_wait_s: float | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[Engine, FakeExecutor]:
    executor = executor if executor is not None else FakeExecutor()
    engine = Engine(
        executor,
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=enable_prefix_caching, namespace=namespace),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                        max_waiting=max_waiting, max_queue_wait_s=max_queue_wait_s),
        FakeDecoder(),
        vocab_size=VOCAB,
        clock=clock,
    )
    return engine, executor


_counter = iter(range(1_000_000))


def make_request(
    prompt: list[int],
    max_tokens: int = 8,
    *,
    request_id: str | None = None,
    priority: int = 0,
    cache_salt: str = "",
    **params: object,
) -> Request:
    n = next(_counter)
    params.setdefault("temperature", 0.0)
    return Request(
        request_id=RequestId(request_id or f"r{n}"),
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        arrival_time=float(n),
        priority=priority,
        cache_salt=cache_salt,
    )


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[RequestId, list[int]]:
    """Step until idle; returns the generated tokens of each request, checking integrity."""
    tokens: dict[RequestId, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            engine.check_integrity()
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    raise AssertionError("engine did not finish")


def prompt_of(length: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % (VOCAB - 1) for i in range(length)]
