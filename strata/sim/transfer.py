"""The simulated prefill/decode hand-off: stand-in KV blocks, their transfer time, and the
decider's default fitted from a latency profile.

A simulated instance has no KV bytes. It exports each held block as a stand-in payload naming
the bytes the profiled model's block would have (`kv_bytes_per_token * block_size`), and the
pull waits the time those bytes need at `--sim-kv-bandwidth-gbps` (`SimulatedExecutor.link_s`,
awaited by the stream, not by the engine, so the decode instance waits for the stream). A
simulated decode instance imports stand-ins of its own size: the blocks count as computed and
its step times skip those prompt tokens, exactly what a real import buys.

    "SIMKV" | modeled bytes u64 | crc32 u32       (ends in its crc32 like every KV payload)
"""

from __future__ import annotations

import math
import struct
import zlib

from strata.sim.profile import LatencyProfile

MAGIC = b"SIMKV"
_BODY = struct.Struct("<5sQ")
DEFAULT_BANDWIDTH_GBPS = 0.5  # the measured loopback pull rate, see docs/benchmarks.md


def stand_in(num_bytes: int) -> bytes:
    body = _BODY.pack(MAGIC, num_bytes)
    return body + struct.pack("<I", zlib.crc32(body))


def modeled_bytes(payload: bytes | bytearray) -> int | None:
    """The bytes a stand-in stands for; None when `payload` is not an intact stand-in."""
    if len(payload) != _BODY.size + 4 or zlib.crc32(payload[:-4]) != int.from_bytes(
            payload[-4:], "little"):
        return None
    magic, num_bytes = _BODY.unpack_from(payload)
    return int(num_bytes) if magic == MAGIC else None


def transfer_s(num_bytes: int, bandwidth_gbps: float) -> float:
    return num_bytes / (bandwidth_gbps * 1e9)


def fit_min_uncached_tokens(profile: LatencyProfile, *, handoff_overhead_ms: float,
                            stall_steps: float = 4.0, decode_batch: int = 8,
                            ttft_slack: float = 0.10, block_size: int = 16) -> int:
    """The smallest uncached prompt worth a remote prefill, rounded up to whole blocks: both

    - prefilled on the decode instance, it would hold a `decode_batch` batch for at least
      `stall_steps` decode steps (shorter prompts barely disturb the streams decoding there),
    - the hand-off's fixed cost (`handoff_overhead_ms`: the extra hops, measured by
      bench/pd_transfer.py) is at most `ttft_slack` of its prefill time.

    The per-token pull is left out: where it exceeds `ttft_slack` of the per-token prefill (it
    does on CPU loopback), no length meets the slack and a remote prefill always costs some TTFT;
    docs/benchmarks.md says how much.
    """
    per_token_ms = profile.prefill_ms_per_token
    if per_token_ms <= 0:
        return 0
    stall_ms = stall_steps * profile.step_ms(0, decode_batch)
    ttft_ms = handoff_overhead_ms / ttft_slack
    tokens = (max(stall_ms, ttft_ms) - profile.prefill_ms_base) / per_token_ms
    return int(math.ceil(max(tokens, 1.0) / block_size) * block_size)


__all__ = ["DEFAULT_BANDWIDTH_GBPS", "MAGIC", "fit_min_uncached_tokens", "modeled_bytes",
           "stand_in", "transfer_s"]
