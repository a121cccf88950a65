"""`TorchExecutor`: the `ModelExecutor` that runs a Llama-family model in PyTorch.

Each `execute` turns the scheduler's `ModelInput` into one `StepBatch` (token ids, positions,
write slots, padded decode gathers, per-chunk causal masks), runs one forward and samples the
sequences that asked for a token. It keeps no state about requests between steps. Given a
`RankShard` and its `ShardComm` it runs one rank of a parallel model (strata.model.parallel):
the same steps over its slices; only the sampling rank returns tokens.
`export_blocks` / `import_blocks` move one block's K and V of every layer in and out of the paged
cache as `kv_codec` payloads (KV offload to an external store).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import Tensor

from strata.engine.executor import ModelInput, ModelOutput, ScheduledSequence
from strata.errors import ConfigError, KVPayloadError
from strata.model import cpu_kernels
from strata.model.attention import PagedKVCache, PrefillChunk, StepBatch
from strata.model.config import ModelConfig
from strata.model.kv_codec import FORMAT_VERSION, KVCodec, KVLayout
from strata.model.llama import LlamaModel, Weights
from strata.model.lora import LoraAdapter, moved, sharded
from strata.model.lora_batch import StackCache, StepLoras, step_loras
from strata.model.masks import MaskWorker
from strata.model.parallel.layout import ParallelLayout
from strata.model.sampler import Sampler
from strata.model.shard import RankShard, ShardComm
from strata.types import KVPayload

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("strata.model")


class TorchExecutor:
    """Runs the model over a step's batch and samples next tokens (see `ModelExecutor`).

    `dtype` is the name of the weight and KV dtype ("float32", "bfloat16" or "float16");
    `device` a torch device string ("cpu", "cuda", "cuda:1"). `model_name` and `model_version`
    go into the header of exported KV blocks, and imported ones must carry the same.
    """

    def __init__(self, config: ModelConfig, weights: Weights, *,
                 dtype: str = "bfloat16", device: str = "cpu", model_name: str = "",
                 model_version: str = "default", shard: RankShard | None = None,
                 comm: ShardComm | None = None) -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.shard = shard or RankShard.full(config)
        self.model = LlamaModel(config, weights, dtype=_DTYPES[dtype], device=device,
                                shard=self.shard, comm=comm)
        self.sampler = Sampler(device)
        self.masks = MaskWorker(config.vocab_size)  # structured output, beside the forward
        # Builds the CPU kernels now, not mid-step. Measured per layer (SmolLM2, bf16, 2 cores),
        # the chunk kernel beats the torch paths at every size: 1.8x for 16 tokens over 1,500,
        # 2.3x for a fresh 512-token prompt, 1.3x for 2,048.
        self.chunk_kernel = cpu_kernels.supports_chunk(_DTYPES[dtype], device, config.head_dim)
        self.kv_cache: PagedKVCache | None = None
        self.kv_codec: KVCodec | None = None
        self._identity = (model_name, model_version)
        self.loras: dict[str, LoraAdapter] = {}  # by content digest; a sequence names one
        self.lora_stacks = StackCache()  # the step's adapters stacked (strata.model.lora_batch)

    def add_lora(self, adapter: LoraAdapter) -> str:
        """Hold `adapter` (the whole model's) by its digest (see `LoraExecutor`): one rank of a
        parallel model keeps its shard's cut of it (`lora.sharded`). A no-op copy when it was
        loaded in the model's dtype and device."""
        if adapter.digest not in self.loras:
            mine = sharded(adapter, self.config, self.shard)
            self.loras[adapter.digest] = moved(mine, _DTYPES[self.dtype], self.device)
        return adapter.digest

    def has_lora(self, digest: str) -> bool:
        return digest in self.loras

    def remove_lora(self, digest: str) -> None:
        self.loras.pop(digest, None)
        self.lora_stacks.forget(digest)

    @property
    def lora_dtype(self) -> torch.dtype:
        """The dtype adapters are held in (load them in it: `add_lora` then copies nothing)."""
        return _DTYPES[self.dtype]

    @property
    def lora_device(self) -> str:
        """The device adapters are held on (load them there: `add_lora` then copies nothing)."""
        return self.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers (of this shard)."""
        full = self.config.kv_bytes_per_token(self.dtype)
        whole = self.config.num_hidden_layers * self.config.num_key_value_heads
        return full * len(self.shard.layers) * len(self.shard.kv_heads) // whole

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate `num_blocks` blocks of `block_size` slots (plus one zero null slot)."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"num_blocks ({num_blocks}) and block_size ({block_size}) "
                              "must be positive")
        num_layers, kv_heads = len(self.shard.layers), len(self.shard.kv_heads)
        self.kv_cache = PagedKVCache(self.config, num_blocks, block_size, _DTYPES[self.dtype],
                                     self.device, num_layers=num_layers, kv_heads=kv_heads)
        self.kv_codec = KVCodec(KVLayout(*self._identity, self.dtype, num_layers, block_size,
                                         kv_heads, self.config.head_dim))

    def kv_layout(self) -> dict[str, Any]:
        """What an exported block's bytes depend on; a P/D hand-off compares it with the peer's
        before the first transfer. `parallel` shows the one rank that holds every head and
        layer (strata.model.parallel.layout)."""
        _, codec = self._kv_transfer()
        return {**asdict(codec.layout), "codec_format": FORMAT_VERSION,
                "payload_bytes": codec.payload_bytes,  # what a shared-memory slot holds
                "parallel": ParallelLayout().describe(self.config)}

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """One `kv_codec` payload per block: K and V of every layer (see `ModelExecutor`)."""
        cache, codec = self._kv_transfer()
        payloads = []
        for b in block_ids:
            block = self._block_bytes(cache, b)
            # on the CPU, one pass gathers and sums the block (kv_codec.encode_runs)
            fast = codec.encode_runs(block.numpy()) if block.device.type == "cpu" else None
            payloads.append(fast or codec.encode(block.cpu().numpy().tobytes()))
        return payloads

    def export_blocks_into(self, block_ids: list[int], buffers: list[memoryview]) -> list[int]:
        """`export_blocks` written into `buffers` (one writable buffer per block: slots of a
        shared-memory pool), gathered and summed in one pass; each payload's length."""
        cache, codec = self._kv_transfer()
        lengths = []
        for b, out in zip(block_ids, buffers, strict=True):
            block = self._block_bytes(cache, b)
            if block.device.type != "cpu" or not codec.encode_into(block.numpy(), out):
                payload = codec.encode(block.cpu().numpy().tobytes())
                out[: len(payload)] = payload
            lengths.append(codec.payload_bytes)
        return lengths

    def import_blocks(self, block_ids: list[int], payloads: list[KVPayload]) -> int:
        """Write payloads into blocks, in order, until one is refused (see `ModelExecutor`)."""
        cache, codec = self._kv_transfer()
        for i, (block_id, payload) in enumerate(zip(block_ids, payloads, strict=True)):
            dest = self._block_bytes(cache, block_id)
            try:
                # on the CPU, one pass scatters and checks the block (kv_codec.decode_into); a
                # refused block's slots are recomputed by the engine, never read
                if dest.device.type == "cpu" and codec.decode_into(payload, dest.numpy()):
                    continue
                body = codec.decode(payload)
            except KVPayloadError as exc:
                log.warning("refused a fetched KV block (recomputed instead): %s", exc)
                return i
            src = np.frombuffer(body, dtype=np.uint8).reshape(dest.shape)
            if dest.device.type == "cpu":
                dest.numpy()[...] = src  # a strided copy straight into the cache
            else:
                dest.copy_(torch.from_numpy(src.copy()))
        return len(payloads)

    def _kv_transfer(self) -> tuple[PagedKVCache, KVCodec]:
        if self.kv_cache is None or self.kv_codec is None:
            raise RuntimeError("invariant kv_cache_allocated: call allocate_kv_cache() first")
        return self.kv_cache, self.kv_codec

    @staticmethod
    def _block_bytes(cache: PagedKVCache, block_id: int) -> Tensor:
        """The block's slots of every layer, K and V, as bytes: (L, 2, B, H, D * itemsize)."""
        start = block_id * cache.block_size
        return cache.data.view(torch.uint8)[:, :, start : start + cache.block_size]

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Compute the step's tokens; sample one token per sequence with `needs_sample`."""
        kv = self.kv_cache
        if kv is None:
            raise RuntimeError("invariant kv_cache_allocated: call allocate_kv_cache() first")
        if model_input.block_size != kv.block_size:
            raise RuntimeError(f"invariant block_size: input uses {model_input.block_size}, "
                               f"the KV cache was allocated with {kv.block_size}")
        if not model_input.sequences:
            return {}
        # Decode rows (one new token) first, so the batched decode attention reads rows 0..D.
        seqs = sorted(model_input.sequences, key=lambda s: len(s.token_ids) > 1)
        sampled = [s for s in seqs if s.needs_sample]
        pending = self.masks.start(sampled) if self.shard.is_last_stage else None
        with torch.inference_mode():
            batch = build_step_batch(seqs, kv.block_size, kv.null_slot, self.device,
                                     chunk_kernel=self.chunk_kernel)
            logits = self.model.forward(batch, kv, self._lora_groups(seqs))
            if not sampled or logits is None:
                return {}
            tokens = self.sampler.sample(
                logits, [s.sampling_params for s in sampled], [s.output_token_ids for s in sampled],
                prompt_token_ids=[s.prompt_token_ids for s in sampled],
                eos_token_ids=[s.eos_token_ids for s in sampled],
                mask=pending.wait(self.device) if pending is not None else None,
                may_modify_logits=True)
        return {s.request_id: t for s, t in zip(sampled, tokens, strict=True)}

    def _lora_groups(self, seqs: list[ScheduledSequence]) -> StepLoras | None:
        """The step's adapters and the token rows of each (in `seqs` order)."""
        rows: dict[str, list[int]] = {}
        start = 0
        for s in seqs:
            n = len(s.token_ids)
            if s.lora_digest:
                rows.setdefault(s.lora_digest, []).extend(range(start, start + n))
            start += n
        groups: list[tuple[LoraAdapter, list[int]]] = []
        for digest, idx in rows.items():
            adapter = self.loras.get(digest)
            if adapter is None:
                raise RuntimeError(f"invariant lora_loaded: no LoRA adapter {digest[:12]} is "
                                   "loaded")
            groups.append((adapter, idx))
        return step_loras(self.lora_stacks, groups, start, self.device)


def build_step_batch(seqs: list[ScheduledSequence], block_size: int, null_slot: int,
                     device: str, *, chunk_kernel: bool = False) -> StepBatch:
    """Indices for one forward; `seqs` must list the one-token sequences first.

    With `chunk_kernel` every prefill chunk is marked for the C chunk kernel (no gathers, masks).
    """
    lengths = [len(s.token_ids) for s in seqs]
    _check_block_tables(seqs, lengths, block_size)
    input_ids = [t for s in seqs for t in s.token_ids]
    positions = [p for s, n in zip(seqs, lengths, strict=True)
                 for p in range(s.start_pos, s.start_pos + n)]
    ends = list(accumulate(lengths))
    sample_rows = [e - 1 for s, e in zip(seqs, ends, strict=True) if s.needs_sample]
    table = _block_table(seqs, device)
    pos = torch.tensor(positions, device=device)
    row_seq = torch.repeat_interleave(torch.tensor(lengths, device=device))
    slot_mapping = table[row_seq, pos // block_size] * block_size + pos % block_size
    num_decodes = sum(1 for n in lengths if n == 1)
    decode_lens = [s.start_pos + 1 for s in seqs[:num_decodes]]
    row_starts = [e - n for e, n in zip(ends, lengths, strict=True)]
    prefills = [_prefill_chunk(seqs[i], table[i], row_starts[i], block_size, chunk_kernel)
                for i in range(num_decodes, len(seqs))]
    return StepBatch(
        input_ids=torch.tensor(input_ids, device=device),
        positions=pos,
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decode_block_table=table[:num_decodes],
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
        prefills=prefills,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        block_size=block_size,
    )


def _check_block_tables(seqs: list[ScheduledSequence], lengths: list[int],
                        block_size: int) -> None:
    for s, n in zip(seqs, lengths, strict=True):
        if n == 0:
            raise RuntimeError(f"invariant non_empty_step: {s.request_id} has no tokens")
        if len(s.block_ids) * block_size < s.start_pos + n:
            raise RuntimeError(
                f"invariant block_table_covers_tokens: {s.request_id} has "
                f"{len(s.block_ids)} blocks of {block_size} for {s.start_pos + n} positions"
            )


def _block_table(seqs: list[ScheduledSequence], device: str) -> Tensor:
    """(num_seqs, max_blocks) block ids; padding entries are never read unmasked."""
    width = max(len(s.block_ids) for s in seqs)
    rows = [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _slots(table_rows: Tensor, pos: Tensor, block_size: int) -> Tensor:
    """Slots of positions `pos` (L,) for each block-table row: (rows, L)."""
    return table_rows[:, pos // block_size] * block_size + pos % block_size


def _prefill_chunk(seq: ScheduledSequence, table_row: Tensor, row_start: int,
                   block_size: int, chunk_kernel: bool) -> PrefillChunk:
    n = len(seq.token_ids)
    if chunk_kernel:
        return PrefillChunk(row_start, row_start + n, None, None, seq.start_pos, table_row)
    if seq.start_pos == 0:
        return PrefillChunk(row_start, row_start + n, None, None)
    device = table_row.device
    pos = torch.arange(seq.start_pos + n, device=device)
    query_pos = torch.arange(seq.start_pos, seq.start_pos + n, device=device)
    mask = pos[None, :] <= query_pos[:, None]
    slots = _slots(table_row[None], pos, block_size)[0]
    return PrefillChunk(row_start, row_start + n, slots, mask, seq.start_pos)
