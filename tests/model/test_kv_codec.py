"""The KV block payload: round trip, and refusal of any other layout or a damaged byte; and the
TorchExecutor's export / import of real cache blocks."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model_dir

from strata.errors import KVPayloadError
from strata.model.executor import TorchExecutor
from strata.model.kv_codec import FORMAT_VERSION, KVCodec, KVLayout
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
