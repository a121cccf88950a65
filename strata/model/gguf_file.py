"""A GGUF file's metadata and tensor list, read in one pass of `struct` over its memory map.

`gguf.GGUFReader` builds a numpy view for every part of every field: on SmolLM2's GGUF, whose
tokenizer is two arrays of about 49,000 strings each, that took about 3 s of CPU per read, and a
`strata serve` of the default model read the header twice (the model, its generation defaults)
and `strata up` once more (the served name). Here a field's value is decoded to Python as it is
met (a string array is a loop over lengths and bytes, a numeric array one `numpy.frombuffer`), so
the same header reads in well under a second. Tensors are what `GGUFReader` gives: the type, the
dims in the file's order (innermost first) and the data as a read-only view of the map, shaped
as gguf-py shapes it (quantized types as rows of bytes), so that `gguf.quants.dequantize` takes
it as it is.

Only little-endian files are read (every file llama.cpp writes today); a big-endian or otherwise
unreadable file raises `ValueError`, which the loader reports with the file's name.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_DEFAULT_ALIGNMENT = 32
# scalar value types: struct format (little-endian)
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
# tensor types whose data gguf-py gives as elements rather than bytes
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` is the file's dims (innermost first), `data` a view of the map."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """Every metadata field by key (decoded to Python values) and every tensor in file order."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values from `buf` at a moving offset."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.offset = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.buf):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = bytes(self.buf[self.offset:end]).decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        return self.unpack(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind = GGUFValueType(self.unpack("<I"))
        count = self.unpack("<Q")
        if kind in _SCALARS and kind != GGUFValueType.BOOL:
            fmt = _SCALARS[kind]
            size = struct.calcsize(fmt) * count
            if self.offset + size > len(self.buf):
                raise ValueError(f"an array of {count} values runs past the end of the file")
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.offset)
            self.offset += size
            return values.tolist()  # type: ignore[no-any-return]
        return [self.value(kind) for _ in range(count)]


def read_gguf(path: Path) -> GGUFFile:
    """The fields and tensors of the GGUF file at `path` (its data stays in the map). Read once
    per process while the file is unchanged: the loader, its generation defaults and `strata up`
    each ask for the same header. The fields are shared: read them, never change them."""
    stat = path.stat()
    return _read(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf)
    except struct.error as e:
        raise ValueError(f"truncated header: {e}") from None


def _parse(buf: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(buf)
    magic = cursor.unpack("<I")
    if magic != GGUF_MAGIC:
        raise ValueError(f"bad magic {magic:#x} (a GGUF file starts with 'GGUF')")
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not read (2 and 3 are; a big-endian file "
                         "reads as another version)")
    tensor_count, field_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(GGUFValueType(cursor.unpack("<I")))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment  # the tensor data begins aligned
    return GGUFFile(fields, _tensors(buf, infos, start))


def _tensor_info(cursor: _Cursor) -> tuple[str, np.ndarray, GGMLQuantizationType, int]:
    name = cursor.string()
    dims = np.array([cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))], dtype=np.uint64)
    return name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")


def _tensors(buf: mmap.mmap, infos: list[tuple[str, np.ndarray, GGMLQuantizationType, int]],
             start: int) -> list[GGUFTensor]:
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        elements = int(np.prod(dims))
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        if kind in _ELEMENT_TYPES:
            dtype: Any = _ELEMENT_TYPES[kind]
            count = elements
        else:
            block, size = GGML_QUANT_SIZES[kind]
            dtype, count = np.uint8, elements * size // block
            shape = quant_shape_to_byte_shape(shape, kind)
        at = start + offset
        if at + count * np.dtype(dtype).itemsize > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(shape)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return tensors


__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]
