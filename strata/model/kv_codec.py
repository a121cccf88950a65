"""The wire format of one KV block in an external store: self-describing, checked, never pickled.

    magic "STKV" | format version u16 | header length u32 | header | body | crc32 u32

The header is compact JSON of the `KVLayout` (model, version, dtype, num_layers, block_size,
num_kv_heads, head_dim; sorted keys). The body is the block's K and V for every layer as raw
little-endian tensor bytes, shape (num_layers, 2, block_size, num_kv_heads, head_dim). The crc32
covers everything before it. A payload is accepted only when its header equals the loaded
model's exactly: the block hash already names model and version, and this check makes sure a
store shared by other weights, dtypes or block sizes can never feed wrong KV into attention.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass

from strata.errors import KVPayloadError
from strata.model.config import DTYPE_BYTES

MAGIC = b"STKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, format version, header length
_CRC = struct.Struct("<I")

@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything KV bytes depend on besides the tokens."""

    model: str
    version: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def body_bytes(self) -> int:
        num_layers, two, block, heads, dim = self.shape
        return num_layers * two * block * heads * dim * DTYPE_BYTES[self.dtype]


class KVCodec:
    """Encodes block bodies of one layout and decodes only payloads of exactly that layout."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        header = json.dumps(asdict(layout), sort_keys=True, separators=(",", ":")).encode()
        self._prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header
        self.payload_bytes = len(self._prefix) + layout.body_bytes + _CRC.size

    def encode(self, body: bytes | memoryview) -> bytes:
        if len(body) != self.layout.body_bytes:
            raise ValueError(f"a KV block body of {self.layout} has {self.layout.body_bytes} "
                             f"bytes, got {len(body)}")
        crc = zlib.crc32(body, zlib.crc32(self._prefix))
        return b"".join((self._prefix, body, _CRC.pack(crc)))

    def decode(self, payload: bytes) -> memoryview:
        """The body of `payload` (a view, no copy); raises KVPayloadError saying what differs."""
        view = memoryview(payload)
        if view[: len(self._prefix)] != self._prefix:
            raise KVPayloadError(self._explain_header(view))
        if len(view) != self.payload_bytes:
            raise KVPayloadError(f"KV payload has {len(view)} bytes, expected "
                                 f"{self.payload_bytes} for {self.layout}")
        end = len(view) - _CRC.size
        (crc,) = _CRC.unpack(view[end:])
        if zlib.crc32(view[:end]) != crc:
            raise KVPayloadError("KV payload checksum mismatch (damaged in the store or in "
                                 "transit)")
        return view[len(self._prefix) : end]

    def _explain_header(self, view: memoryview) -> str:
        if len(view) < _PREFIX.size:
            return f"KV payload too short ({len(view)} bytes) to hold a header"
        magic, version, header_len = _PREFIX.unpack(view[: _PREFIX.size])
        if magic != MAGIC:
            return f"not a Strata KV payload (magic {bytes(magic)!r}, expected {MAGIC!r})"
        if version != FORMAT_VERSION:
            return f"KV payload format version {version}; this build reads {FORMAT_VERSION}"
        try:
            found = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
        except ValueError:
            return "KV payload header is not valid JSON"
        expected = asdict(self.layout)
        diffs = [f"{k}={found.get(k)!r} (expected {v!r})" for k, v in expected.items()
                 if found.get(k) != v]
        return "KV payload is for another layout: " + (", ".join(diffs) or "header differs")


__all__ = ["FORMAT_VERSION", "MAGIC", "KVCodec", "KVLayout", "KVPayloadError"]
