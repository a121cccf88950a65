"""The wire format of one KV block in an external store: self-describing, checked, never pickled.

    magic "STKV" | format version u16 | header length u32 | header | body | crc32 u32

The header is compact JSON of the `KVLayout` (model, version, dtype, num_layers, block_size,
num_kv_heads, head_dim; sorted keys). The body is the block's K and V for every layer as raw
little-endian tensor bytes, shape (num_layers, 2, block_size, num_kv_heads, head_dim). The crc32
covers everything before it (`crc32`: zlib's value, summed by the C kernels at memory speed
where this process has built them, crc32.h; `encode_runs` and `decode_into` copy a block out of
or into a paged cache and sum it in the same pass). A payload is accepted only when its header
equals the loaded model's exactly: the block hash already names model and version, and this
check makes sure a store shared by other weights, dtypes or block sizes can never feed wrong KV
into attention.
"""

from __future__ import annotations

import ctypes
import json
import struct
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from strata.errors import KVPayloadError
from strata.model.config import DTYPE_BYTES
from strata.model.kernel_build import built_kernel_library

MAGIC = b"STKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, format version, header length
_CRC = struct.Struct("<I")
_MIN_C_BYTES = 4096  # below this zlib's call is cheaper than reaching the C kernel


def _folding_kernels(num_bytes: int = _MIN_C_BYTES) -> ctypes.CDLL | None:
    """The C kernels where this process built them and their crc32 folds (else zlib and plain
    copies are faster), for `num_bytes` at least `_MIN_C_BYTES`."""
    lib = built_kernel_library()
    if lib is None or num_bytes < _MIN_C_BYTES or not lib.kv_crc32_folds():
        return None
    return lib


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib.crc32(data, value), from the C kernels where this process built them (7-12 GB/s
    on the AMX Xeon against zlib's 2.2)."""
    view = memoryview(data)
    lib = _folding_kernels(view.nbytes)
    if lib is None:
        return zlib.crc32(view, value)
    array = np.frombuffer(view, dtype=np.uint8)
    return int(lib.kv_crc32(array.ctypes.data, array.size, value))


def copy_crc32(source: bytes | memoryview, into: bytearray) -> int:
    """Copies `source` to the start of `into` and answers zlib.crc32 of its bytes, in one pass
    where this process built the C kernels (a block read out of shared memory: what is summed
    is what is kept)."""
    view = memoryview(source)
    if len(into) < view.nbytes:
        raise ValueError(f"{view.nbytes} bytes do not fit in {len(into)}")
    lib = _folding_kernels(view.nbytes)
    if lib is None:
        into[: view.nbytes] = view
        return zlib.crc32(memoryview(into)[: view.nbytes])
    src = np.frombuffer(view, dtype=np.uint8)
    dst = np.frombuffer(into, dtype=np.uint8)
    crc = lib.kv_copy_crc32(dst.ctypes.data, view.nbytes, src.ctypes.data, view.nbytes,
                            view.nbytes, 1, 0)
    return int(crc)


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
        crc = crc32(body, zlib.crc32(self._prefix))
        return b"".join((self._prefix, body, _CRC.pack(crc)))

    def encode_runs(self, runs: np.ndarray) -> bytes | None:
        """The payload of a block whose body is `runs` (a uint8 array whose last axis is
        contiguous, e.g. a paged cache's slots of one block): copied and summed in one pass by
        the C kernels (crc32.h). None where they are not built (call `encode`)."""
        buffer = bytearray(self.payload_bytes)
        return bytes(buffer) if self.encode_into(runs, memoryview(buffer)) else None

    def encode_into(self, runs: np.ndarray, out: memoryview) -> bool:
        """`encode_runs` written into `out` (writable, `payload_bytes` long at least: a slot of
        a shared-memory pool); False, nothing written, where the C kernels are not built or
        `runs` is not one stride of equal runs."""
        found = self._body_runs(runs)
        if found is None:
            return False
        lib, (base, stride, run, count) = found
        if out.readonly or out.nbytes < self.payload_bytes:
            raise ValueError(f"a KV payload needs {self.payload_bytes} writable bytes, got "
                             f"{out.nbytes}{' read-only' if out.readonly else ''}")
        target = np.frombuffer(out, dtype=np.uint8)
        head = len(self._prefix)
        target[:head] = np.frombuffer(self._prefix, dtype=np.uint8)
        crc = lib.kv_copy_crc32(target.ctypes.data + head, run, base, stride, run, count,
                                zlib.crc32(self._prefix))
        _CRC.pack_into(out, head + self.layout.body_bytes, crc)
        return True

    def decode_into(self, payload: bytes | bytearray | memoryview, runs: np.ndarray) -> bool:
        """Writes `payload`'s body into `runs` (as `encode_runs` reads them), checking its
        header and checksum in the same pass; raises KVPayloadError as `decode` does (the runs
        then hold bytes that must not be used: the caller recomputes them). False where the C
        kernels are not built (call `decode`)."""
        found = self._body_runs(runs) if runs.flags.writeable else None
        if found is None:
            return False
        lib, (base, stride, run, count) = found
        view = memoryview(payload)
        head = len(self._prefix)
        if view[:head] != self._prefix:
            raise KVPayloadError(self._explain_header(view))
        if len(view) != self.payload_bytes:
            raise KVPayloadError(f"KV payload has {len(view)} bytes, expected "
                                 f"{self.payload_bytes} for {self.layout}")
        source = np.frombuffer(view, dtype=np.uint8)
        crc = lib.kv_copy_crc32(base, stride, source.ctypes.data + head, run, run, count,
                                zlib.crc32(self._prefix))
        (expected,) = _CRC.unpack_from(view, head + self.layout.body_bytes)
        if crc != expected:
            raise KVPayloadError("KV payload checksum mismatch (damaged in the store or in "
                                 "transit)")
        return True

    def _body_runs(self, runs: np.ndarray) -> tuple[ctypes.CDLL, tuple[int, int, int, int]] | None:
        """The folding kernels and `runs` as (address, stride, run, count) for the one-pass
        copies; None where either is missing; a ValueError when they are not one body."""
        lib = _folding_kernels()
        rows = _as_runs(runs)
        if lib is None or rows is None:
            return None
        if rows[2] * rows[3] != self.layout.body_bytes:
            raise ValueError(f"a KV block body of {self.layout} has {self.layout.body_bytes} "
                             f"bytes, the runs {rows[2] * rows[3]}")
        return lib, rows

    def decode(self, payload: bytes | bytearray | memoryview) -> memoryview:
        """The body of `payload` (a view, no copy); raises KVPayloadError saying what differs."""
        view = memoryview(payload)
        if view[: len(self._prefix)] != self._prefix:
            raise KVPayloadError(self._explain_header(view))
        if len(view) != self.payload_bytes:
            raise KVPayloadError(f"KV payload has {len(view)} bytes, expected "
                                 f"{self.payload_bytes} for {self.layout}")
        end = len(view) - _CRC.size
        (crc,) = _CRC.unpack(view[end:])
        if crc32(view[:end]) != crc:
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


def _as_runs(array: np.ndarray) -> tuple[int, int, int, int] | None:
    """(address, stride, run bytes, number of runs) of a uint8 array laid out as equal-length
    contiguous runs at one stride (the innermost contiguous axes make the run, the others must
    step uniformly); None otherwise."""
    if array.dtype != np.uint8 or array.ndim < 1 or array.size == 0 or array.strides[-1] != 1:
        return None
    run = array.shape[-1]
    axes = [(n, st) for n, st in zip(array.shape[:-1], array.strides[:-1], strict=True) if n > 1]
    while axes and axes[-1][1] == run:
        run *= axes.pop()[0]
    if not axes:
        return array.ctypes.data, run, run, 1
    count, stride = axes.pop()
    while axes:
        n, st = axes.pop()
        if st != stride * count:
            return None
        count *= n
    if stride < run:
        return None
    return array.ctypes.data, stride, run, count


__all__ = ["FORMAT_VERSION", "MAGIC", "KVCodec", "KVLayout", "KVPayloadError", "copy_crc32",
           "crc32"]
