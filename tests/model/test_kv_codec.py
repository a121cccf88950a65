"""The KV block payload: round trip, and refusal of any other layout or a damaged byte; the
checksum and one-pass copies of the C kernels against zlib and the plain path; and the
TorchExecutor's export / import of real cache blocks."""

from __future__ import annotations

import dataclasses
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model_dir

from strata.errors import KVPayloadError
from strata.model.executor import TorchExecutor
from strata.model.kernel_build import kernel_library
from strata.model.kv_codec import FORMAT_VERSION, KVCodec, KVLayout, crc32
from strata.model.loader import LoadedModel, load_model

LAYOUT = KVLayout(model="tiny", version="v1", dtype="float16", num_layers=2, block_size=4,
                  num_kv_heads=2, head_dim=8)


def body(layout: KVLayout = LAYOUT, seed: int = 0) -> bytes:
    return bytes((seed + 31 * i) % 256 for i in range(layout.body_bytes))


def test_round_trip() -> None:
    codec = KVCodec(LAYOUT)
    payload = codec.encode(body())
    assert payload.startswith(b"STKV")
    assert len(payload) == codec.payload_bytes
    assert bytes(codec.decode(payload)) == body()


@pytest.mark.parametrize("field,value", [("model", "other"), ("version", "v2"),
                                         ("dtype", "bfloat16"), ("num_layers", 3),
                                         ("block_size", 8), ("num_kv_heads", 1),
                                         ("head_dim", 4)])
def test_another_layout_is_refused_naming_the_difference(field: str, value: object) -> None:
    other = dataclasses.replace(LAYOUT, **{field: value})
    payload = KVCodec(other).encode(body(other))
    with pytest.raises(KVPayloadError, match=f"{field}={value!r} \\(expected"):
        KVCodec(LAYOUT).decode(payload)


def test_a_flipped_byte_anywhere_is_refused() -> None:
    codec = KVCodec(LAYOUT)
    payload = codec.encode(body())
    for index in (len(payload) // 2, len(payload) - 1, len(payload) - 6):
        damaged = bytearray(payload)
        damaged[index] ^= 0x01
        with pytest.raises(KVPayloadError, match="checksum"):
            codec.decode(bytes(damaged))


def test_truncated_foreign_and_future_payloads_are_refused() -> None:
    codec = KVCodec(LAYOUT)
    payload = codec.encode(body())
    with pytest.raises(KVPayloadError, match="expected"):
        codec.decode(payload[:-1])
    with pytest.raises(KVPayloadError, match="too short"):
        codec.decode(b"ST")
    with pytest.raises(KVPayloadError, match="not a Strata KV payload"):
        codec.decode(b"PK\x03\x04" + payload[4:])
    future = struct.pack("<4sH", b"STKV", FORMAT_VERSION + 1) + payload[6:]
    with pytest.raises(KVPayloadError, match=f"format version {FORMAT_VERSION + 1}"):
        codec.decode(future)


def test_encode_refuses_a_body_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match=f"has {LAYOUT.body_bytes} bytes, got 3"):
        KVCodec(LAYOUT).encode(b"abc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("kvcodec") / "m")
    return load_model(Path(path), dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_executor_exports_and_imports_whole_blocks(tiny: LoadedModel, dtype: str) -> None:
    source = TorchExecutor(tiny.config, tiny.weights, dtype=dtype, model_name="tiny")
    target = TorchExecutor(tiny.config, tiny.weights, dtype=dtype, model_name="tiny")
    source.allocate_kv_cache(8, 4)
    target.allocate_kv_cache(8, 4)
    assert source.kv_cache is not None and target.kv_cache is not None
    source.kv_cache.data.copy_(torch.randn(source.kv_cache.data.shape))
    payloads = source.export_blocks([5, 2])
    assert target.import_blocks([0, 7], payloads) == 2
    src, dst = source.kv_cache.data, target.kv_cache.data
    assert torch.equal(dst[:, :, 0:4], src[:, :, 20:24])
    assert torch.equal(dst[:, :, 28:32], src[:, :, 8:12])
    assert torch.count_nonzero(dst[:, :, 32]) == 0  # the null slot is untouched


def test_executor_refuses_another_version_and_stops_there(tiny: LoadedModel) -> None:
    v1 = TorchExecutor(tiny.config, tiny.weights, dtype="float32", model_version="v1")
    v2 = TorchExecutor(tiny.config, tiny.weights, dtype="float32", model_version="v2")
    for executor in (v1, v2):
        executor.allocate_kv_cache(4, 4)
    good = v2.export_blocks([0])[0]
    assert v2.import_blocks([1, 2], [good, v1.export_blocks([0])[0]]) == 1


# --- the checksum and the checked block copies of the C kernels (crc32.h) ---------------------


@pytest.fixture(scope="module")
def kernels() -> None:
    if kernel_library() is None:
        pytest.skip("no C compiler: the codec uses zlib and the plain copies")


@pytest.mark.parametrize("size", [0, 1, 15, 63, 64, 65, 127, 4095, 4096, 4097, 6144, 65_551,
                                  1 << 20])
def test_crc32_is_zlibs_at_every_length_and_start(kernels: None, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for start in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert crc32(data, start) == zlib.crc32(data, start)
        assert crc32(memoryview(data)[3:], start) == zlib.crc32(data[3:], start)


def _strided_block(codec: KVCodec, seed: int) -> np.ndarray:
    """One block's bytes inside a larger paged cache: (layers, 2, block, heads, dim bytes)."""
    lay = codec.layout
    cache = np.random.default_rng(seed).integers(
        0, 256, (lay.num_layers, 2, 5 * lay.block_size, lay.num_kv_heads, lay.head_dim * 2),
        dtype=np.uint8)
    return cache[:, :, 2 * lay.block_size: 3 * lay.block_size]


def test_the_one_pass_encode_and_decode_are_the_plain_ones(kernels: None) -> None:
    codec = KVCodec(LAYOUT)
    block = _strided_block(codec, 1)
    payload = codec.encode_runs(block)
    assert payload == codec.encode(block.tobytes())
    target = np.zeros_like(_strided_block(codec, 2).base)
    dest = target[:, :, LAYOUT.block_size: 2 * LAYOUT.block_size]
    assert codec.decode_into(payload, dest)
    assert np.array_equal(dest, block)
    assert np.count_nonzero(target[:, :, :LAYOUT.block_size]) == 0  # nothing outside it


def test_the_one_pass_decode_refuses_a_flipped_byte_and_another_layout(kernels: None) -> None:
    codec = KVCodec(LAYOUT)
    payload = bytearray(codec.encode_runs(_strided_block(codec, 3)) or b"")
    dest = np.zeros_like(_strided_block(codec, 4))
    for index in (len(payload) // 2, len(payload) - 5, len(payload) - 1):
        damaged = bytearray(payload)
        damaged[index] ^= 0x10
        with pytest.raises(KVPayloadError, match="checksum"):
            codec.decode_into(bytes(damaged), dest)
    other = KVCodec(dataclasses.replace(LAYOUT, version="v2"))
    with pytest.raises(KVPayloadError, match="version='v1'"):
        other.decode_into(bytes(payload), dest)


def test_layouts_that_are_not_uniform_runs_take_the_plain_path(kernels: None) -> None:
    codec = KVCodec(LAYOUT)
    block = _strided_block(codec, 5)
    assert codec.encode_runs(block[:, ::-1]) is None  # K after V: not one stride
    assert not codec.decode_into(codec.encode(block.tobytes()), block[:, :, :, :, ::2])


def test_executor_exports_in_one_pass_what_the_plain_path_exports(tiny: LoadedModel) -> None:
    executor = TorchExecutor(tiny.config, tiny.weights, dtype="bfloat16", model_name="tiny")
    executor.allocate_kv_cache(8, 4)
    assert executor.kv_cache is not None and executor.kv_codec is not None
    executor.kv_cache.data.copy_(torch.randn(executor.kv_cache.data.shape))
    plain = [executor.kv_codec.encode(executor.kv_cache.data.view(torch.uint8)[:, :, s:s + 4]
                                      .numpy().tobytes()) for s in (12, 0)]
    assert executor.export_blocks([3, 0]) == plain
    slots = [bytearray(executor.kv_codec.payload_bytes + 100) for _ in range(2)]
    lengths = executor.export_blocks_into([3, 0], [memoryview(slot) for slot in slots])
    assert [bytes(slot[:n]) for slot, n in zip(slots, lengths, strict=True)] == plain


@pytest.mark.parametrize("run", [1, 15, 16, 63, 64, 65, 100, 6151])
def test_the_checked_copy_copies_and_sums_runs_of_any_length(kernels: None, run: int) -> None:
    lib = kernel_library()
    assert lib is not None
    rng = np.random.default_rng(run)
    source = rng.integers(0, 256, 5 * (run + 13), dtype=np.uint8)
    target = np.zeros(5 * run + 7, dtype=np.uint8)
    crc = lib.kv_copy_crc32(target.ctypes.data, run, source.ctypes.data, run + 13, run, 5, 7)
    runs = b"".join(source[i * (run + 13): i * (run + 13) + run].tobytes() for i in range(5))
    assert target[: 5 * run].tobytes() == runs and not target[5 * run:].any()
    assert crc == zlib.crc32(runs, 7)
