"""`SimulatedExecutor`: a `ModelExecutor` that sleeps for the modelled step time and returns
deterministic pseudo-random tokens. No torch: 64 of these fit on one machine. For a hand-off it
exports and imports stand-ins of KV blocks (strata/sim/transfer.py).

A sequence of the step is *decode* when it computes exactly one token past its prompt; every
other sequence is *prefill* and all its scheduled tokens count (tokens served by the prefix cache
are never scheduled, so a hit shortens the step by itself).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from strata.engine.executor import ModelInput, ModelOutput, SampledToken, ScheduledSequence
from strata.engine.request import Logprob
from strata.sim.profile import LatencyProfile
from strata.sim.transfer import DEFAULT_BANDWIDTH_GBPS, modeled_bytes, stand_in, transfer_s
from strata.types import KVPayload

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the latency model sees of one step."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int


def step_shape(model_input: ModelInput) -> StepShape:
    prefill = decode = context = 0
    for seq in model_input.sequences:
        if len(seq.token_ids) == 1 and seq.start_pos >= len(seq.prompt_token_ids):
            decode += 1
            context += seq.start_pos + 1
        else:
            prefill += len(seq.token_ids)
    return StepShape(prefill, decode, context)


class SimulatedExecutor:
    """Implements `strata.engine.executor.ModelExecutor` from a `LatencyProfile`.

    `token_ids` are the ids it generates (default: every id below `vocab_size`); it never emits
    an EOS: requests end by max_tokens, stop strings or stop token ids, as the client asked.
    The token at output index i depends only on (seed, request seed or prompt, i) when the
    request is seeded or greedy, else on (seed, request id, i): never on the batch.
    """

    def __init__(self, profile: LatencyProfile, vocab_size: int, *,
                 sleep: Callable[[float], None] = time.sleep, seed: int = 0,
                 token_ids: Sequence[int] | None = None,
                 kv_bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS) -> None:
        self.profile = profile
        self.kv_bandwidth_gbps = kv_bandwidth_gbps
        self.block_size = 0
        self.vocab_size = vocab_size
        self.sleep = sleep
        self.seed = seed
        self.token_ids = list(token_ids) if token_ids is not None else list(range(vocab_size))
        self.num_steps = 0
        self.busy_s = 0.0  # modelled time slept, in total

    def kv_bytes_per_token(self) -> int:
        return self.profile.kv_bytes_per_token or 1

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size  # the block tables are the engine's: no tensor to hold

    # --- the prefill/decode hand-off: stand-ins for KV blocks (strata/sim/transfer.py) -------

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token() * self.block_size

    def kv_layout(self) -> dict[str, object]:
        return {"dtype": "simulated", "kv_bytes_per_token": self.kv_bytes_per_token(),
                "codec_format": "simulated-1"}

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Stand-ins, at once: the time their bytes take is the link's (`link_s`)."""
        return [stand_in(self.block_bytes) for _ in block_ids]

    def link_s(self, num_blocks: int) -> float:
        """The time `num_blocks` modeled blocks take over the modeled link; the pull waits it
        (the stream waits, not the engine)."""
        return transfer_s(self.block_bytes * num_blocks, self.kv_bandwidth_gbps)

    def import_blocks(self, block_ids: list[int], payloads: list[KVPayload]) -> int:
        for i, payload in enumerate(payloads):
            if modeled_bytes(payload) != self.block_bytes:
                return i  # not a stand-in of this profile's blocks: recomputed
        return len(payloads)

    def execute(self, model_input: ModelInput) -> ModelOutput:
        shape = step_shape(model_input)
        duration_s = self.profile.step_time_s(shape.num_prefill_tokens, shape.num_decode_seqs,
                                              shape.num_context_tokens)
        self.num_steps += 1
        self.profile.faults.check(self.num_steps, model_input)
        self.busy_s += duration_s
        if duration_s > 0:
            self.sleep(duration_s)
        return {seq.request_id: self._sample(seq)
                for seq in model_input.sequences if seq.needs_sample}

    def _sample(self, seq: ScheduledSequence) -> SampledToken:
        digest = self._digest(seq)
        index = int.from_bytes(digest[:8], "little") % len(self.token_ids)
        num_top = seq.sampling_params.logprobs
        if num_top is None:
            return SampledToken(self.token_ids[index])
        return SampledToken(self.token_ids[index], self._logprob(index, digest, num_top))

    def _digest(self, seq: ScheduledSequence) -> bytes:
        params = seq.sampling_params
        h = hashlib.blake2b(struct.pack("<qq", self.seed, len(seq.output_token_ids)),
                            digest_size=16)
        if params.seed is not None:  # as "<q" for an int64; any int hashes (mod 2**64)
            h.update(b"s" + struct.pack("<Q", params.seed & _MASK64))
        elif params.is_greedy:
            h.update(b"g" + struct.pack(f"<{len(seq.prompt_token_ids)}q", *seq.prompt_token_ids))
        else:
            h.update(b"r" + seq.request_id.encode())
        return h.digest()

    def _logprob(self, index: int, digest: bytes, num_top: int) -> Logprob:
        """A plausible log-probability in (-2.5, -0.05]; the alternatives (the next ids of
        `token_ids`) are less likely, in order."""
        chosen = -0.05 - 2.45 * digest[8] / 256
        gap = 0.5 + digest[9] / 256
        n = len(self.token_ids)
        top = [(self.token_ids[(index + k) % n], chosen - k * gap) for k in range(min(num_top, n))]
        return Logprob(self.token_ids[index], chosen, top)


__all__ = ["SimulatedExecutor", "StepShape", "step_shape"]
