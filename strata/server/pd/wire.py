"""The bytes of a prefill/decode hand-off: the handle P answers and the pull stream of blocks.

Handle: compact JSON (`Handle.to_json`), passed by the gateway to D in `X-Strata-Handoff`.
It names the prompt by its length and a digest over its tokens, the hash namespace (model and
version), the cache salt and the LoRA adapter's digest (its files'), so D never uses a token P
sampled for another prompt, model or adapter weights. The
gateway adds P's instance id and URL and seals every field with the fleet's internal key
(strata/protocol/seal.py); D follows only a handle its fleet wrote (pd/trust.py).

Pull stream (`GET {P}/internal/kv/{handle}`), binary, never JSON or base64:

    "STPD" | format u16 | num_blocks u32          then num_blocks times:
    chain hash (16 bytes) | length u32 | payload  (a KV payload ending in its crc32)

A stream that ends before `num_blocks` blocks is truncated: D keeps the blocks that arrived
whole and checked, and recomputes the rest.
"""

from __future__ import annotations

import hashlib
import json
import struct
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from strata.engine.request import Logprob
from strata.errors import InvalidRequestError, KVPayloadError
from strata.model.kv_codec import copy_crc32, crc32
from strata.types import BlockHash

MAGIC = b"STPD"
FORMAT = 1
_HEAD = struct.Struct("<4sHI")
_BLOCK = struct.Struct("<16sI")
_CRC = struct.Struct("<I")
HASH_BYTES = 16


def prompt_digest(token_ids: list[int], namespace: str, cache_salt: str,
                  lora_digest: str = "") -> str:
    """Names a prompt exactly: its tokens under one model, version, salt and LoRA adapter (the
    digest of its files: a D whose adapter of that name has other weights recomputes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{namespace}|{cache_salt}".encode())
    if lora_digest:  # a base prompt's digest is what it was before adapters
        h.update(f"|lora:{lora_digest}".encode())
    h.update(b"\x00")
    h.update(array("q", token_ids).tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Handle:
    """What P answers for a prefill-only request (see the module docstring)."""

    handle: str
    epoch: str  # P's process: a restarted P never honours its predecessor's handles
    num_prompt_tokens: int
    prompt_digest: str
    num_blocks: int  # full prompt blocks held under the lease
    token_id: int  # the first token P sampled
    num_cached_tokens: int  # prompt tokens P's prefix cache served
    lease_s: float
    logprob: float | None = None  # of token_id, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    url: str = ""  # P's URL: the gateway fills it in
    instance_id: str = ""  # P's instance id: the gateway fills it in
    seal: str = ""  # the gateway's seal over every other field (strata/protocol/seal.py)

    @property
    def first_logprob(self) -> Logprob | None:
        if self.logprob is None:
            return None
        return Logprob(self.token_id, self.logprob, list(self.top_logprobs))

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Handle:
        """Parses a handle; a malformed one is a 400 naming what is wrong."""
        return cls.of(parse_handle_json(text))

    @classmethod
    def of(cls, data: dict[str, Any]) -> Handle:
        """The handle of a parsed JSON object; a malformed one is a 400."""
        try:
            fields = dict(data)
            fields["top_logprobs"] = [(int(t), float(v))
                                      for t, v in fields.get("top_logprobs", [])]
            handle = cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"malformed hand-off handle: {exc}") from None
        if not handle.url.startswith(("http://", "https://")):
            raise InvalidRequestError("hand-off handle without the prefill instance's URL")
        return handle


def parse_handle_json(text: str) -> dict[str, Any]:
    """The JSON object of a handle's text; anything else is a 400."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"malformed hand-off handle: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("malformed hand-off handle: not a JSON object")
    return data


def stream_head(num_blocks: int) -> bytes:
    return _HEAD.pack(MAGIC, FORMAT, num_blocks)


def block_frame(block_hash: BlockHash, payload: bytes) -> bytes:
    return _BLOCK.pack(block_hash, len(payload)) + payload


def checksum_ok(payload: bytes) -> bool:
    """A KV payload ends with the crc32 of every byte before it (kv_codec's format and the
    simulator's stand-in alike)."""
    if len(payload) < _CRC.size:
        return False
    (crc,) = _CRC.unpack_from(payload, len(payload) - _CRC.size)
    return crc32(memoryview(payload)[: -_CRC.size]) == crc


def checked_copy(payload: memoryview, into: bytearray) -> bool:
    """Copies a KV payload into `into` (exactly its length), checked as `checksum_ok` checks
    (in the same pass where the C kernels are built); False when the check fails."""
    if len(payload) < _CRC.size or len(into) != len(payload):
        return False
    end = len(payload) - _CRC.size
    (crc,) = _CRC.unpack_from(payload, end)
    if copy_crc32(payload[:end], into) != crc:
        return False
    _CRC.pack_into(into, end, crc)
    return True


class BlockReader:
    """Parses a pull stream fed in arbitrary chunks; yields (hash, payload) as blocks complete."""

    def __init__(self, max_block_bytes: int = 1 << 30) -> None:
        self.num_blocks: int | None = None
        self.num_read = 0
        self.max_block_bytes = max_block_bytes
        self._buffer = bytearray()

    @property
    def is_complete(self) -> bool:
        return self.num_blocks is not None and self.num_read == self.num_blocks

    def feed(self, chunk: bytes) -> Iterator[tuple[BlockHash, bytes]]:
        self._buffer += chunk
        if self.num_blocks is None:
            if len(self._buffer) < _HEAD.size:
                return
            magic, version, self.num_blocks = _HEAD.unpack_from(self._buffer)
            if magic != MAGIC or version != FORMAT:
                raise KVPayloadError(f"not a Strata block stream (magic {bytes(magic)!r}, "
                                  f"format {version}; expected {MAGIC!r}, {FORMAT})")
            del self._buffer[: _HEAD.size]
        while not self.is_complete and len(self._buffer) >= _BLOCK.size:
            block_hash, length = _BLOCK.unpack_from(self._buffer)
            if length > self.max_block_bytes:
                raise KVPayloadError(f"a block of {length} bytes is over the limit")
            end = _BLOCK.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[_BLOCK.size : end])
            del self._buffer[:end]
            self.num_read += 1
            yield BlockHash(block_hash), payload


__all__ = ["HASH_BYTES", "BlockReader", "Handle", "KVPayloadError", "block_frame", "checked_copy",
           "checksum_ok",
           "parse_handle_json", "prompt_digest", "stream_head"]
