"""Fault injection for hand-off tests: kill points and damaged blocks, set by a test's config
file (`strata serve --fault-config FILE`), never by timing.

    {"kill_at": "decode_during_pull", "after": 0}   SIGKILL this process the (after+1)-th time
                                                    it reaches the point
    {"corrupt_block": 1}                            P flips a byte of block 1's payload in
                                                    every pull (D must recompute it)
    {"corrupt_hash_block": 0}                       P sends block 0 under a wrong chain hash
    {"share_fault": {"rank": 0, "prompt_run": [5, 6, 5, 6], "at_call": 1}}
                                                    a parallel instance's rank 0 cannot run its
                                                    share of any step of a request whose prompt
                                                    holds that run of token ids (failure
                                                    isolation, strata/model/parallel/share.py)

Kill points, in the order a hand-off reaches them:
    prefill_before_answer   P computed and holds the blocks, before it answers the handle
    decode_before_pull      D parsed the handle, before it asks P for anything
    prefill_during_pull     P sent the stream head and the first block
    decode_during_pull      D received the first block
    decode_after_pull       D has every block, before the engine imports them (no ack yet)
    decode_mid_stream       D sent its first frame (streams) or has the first token (else)
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from strata.errors import ConfigError
from strata.types import BlockHash

SHARE_FAULT_FIELDS = ("rank", "token_id", "prompt_run", "at_call", "is_fatal")
KILL_POINTS = ("prefill_before_answer", "decode_before_pull", "prefill_during_pull",
               "decode_during_pull", "decode_after_pull", "decode_mid_stream")


@dataclass(frozen=True, slots=True)
class FaultConfig:
    kill_at: str | None = None
    after: int = 0
    corrupt_block: int | None = None
    corrupt_hash_block: int | None = None
    share_fault: dict[str, Any] | None = None  # ShareFault's fields (a parallel instance's)

    def __post_init__(self) -> None:
        if self.share_fault is not None and (
                not isinstance(self.share_fault, dict) or "rank" not in self.share_fault
                or set(self.share_fault) - set(SHARE_FAULT_FIELDS)):
            raise ConfigError(f"fault config: share_fault wants an object with rank and keys "
                              f"among {', '.join(SHARE_FAULT_FIELDS)}, got {self.share_fault!r}")
        if self.kill_at is not None and self.kill_at not in KILL_POINTS:
            raise ConfigError(f"unknown kill point {self.kill_at!r}; valid: "
                              f"{', '.join(KILL_POINTS)}")
        if self.after < 0:
            raise ConfigError(f"fault config: after must be >= 0, got {self.after}")

    @classmethod
    def load(cls, path: Path) -> FaultConfig:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the fault config {path}: {exc}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ConfigError(f"fault config {path}: expected an object with keys among "
                              f"{', '.join(sorted(known))}")
        return cls(**data)


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    """The configured faults of one process (no config: every call is a no-op)."""

    def __init__(self, config: FaultConfig | None = None,
                 kill: Callable[[], None] = _sigkill) -> None:
        self.config = config or FaultConfig()
        self.kill = kill
        self._num_reached = 0

    def reached(self, point: str) -> None:
        if point != self.config.kill_at:
            return
        self._num_reached += 1
        if self._num_reached > self.config.after:
            self.kill()

    def damages(self, index: int) -> bool:
        """Whether block `index` of a pull leaves P damaged."""
        return index in (self.config.corrupt_block, self.config.corrupt_hash_block)

    def damage(self, index: int, block_hash: BlockHash,
               payload: bytes) -> tuple[BlockHash, bytes]:
        """Block `index` of a pull as it leaves P (damaged when the config says so)."""
        if index == self.config.corrupt_block:
            middle = len(payload) // 2
            payload = payload[:middle] + bytes([payload[middle] ^ 0x01]) + payload[middle + 1:]
        if index == self.config.corrupt_hash_block:
            block_hash = BlockHash(bytes(b ^ 0xFF for b in block_hash))
        return block_hash, payload


__all__ = ["KILL_POINTS", "FaultConfig", "Faults"]
