"""Fakes for engine tests: an executor whose 'KV cache' stores token ids.

The next token is a hash of the whole context *as read back from the paged cache through the
block table*, so any bookkeeping error (a wrong block reused, a slot overwritten, a missing chunk)
changes the tokens produced and fails the comparison with `reference_tokens`.
"""

from __future__ import annotations

import hashlib

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelInput, ModelOutput, SampledToken
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
            for i, tok in enumerate(seq.token_ids):
                self.slots[self._slot(seq.block_ids, seq.start_pos + i)] = tok
            if seq.needs_sample:
                end = seq.start_pos + len(seq.token_ids)
                context = [self.slots[self._slot(seq.block_ids, p)] for p in range(end)]
                assert all(t is not None for t in context), "read an unwritten KV slot"
                salt = _seed_salt(seq.sampling_params, len(seq.output_token_ids))
                tok = next_token(context, salt)  # type: ignore[arg-type]
                lp = Logprob(tok, -0.5) if seq.sampling_params.logprobs is not None else None
                out[seq.request_id] = SampledToken(tok, lp)
        return out

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


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
) -> tuple[Engine, FakeExecutor]:
    executor = FakeExecutor()
    engine = Engine(
        executor,
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=enable_prefix_caching, namespace=namespace),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                        max_waiting=max_waiting),
        FakeDecoder(),
        vocab_size=VOCAB,
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
