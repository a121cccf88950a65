"""strata/model/gguf_file.py reads what gguf-py's GGUFReader reads: every value type, arrays of
each, tensors of every type Strata serves, with the data where gguf-py finds it; and a file cut
anywhere is refused, never read short."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from strata.model.gguf_file import read_gguf

Q = gguf.GGMLQuantizationType


def _write_every_kind(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 1e-6)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "héllo 世界 🙂")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1e-6])
    writer.add_array("t.words", ["a", "", "ü" * 40])
    writer.add_array("t.flags", [True, False, True])
    rng = np.random.default_rng(0)
    writer.add_tensor("dense", rng.standard_normal((4, 64), dtype=np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 32)).astype(np.float16))
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        rows = rng.standard_normal((2, 64), dtype=np.float32)
        writer.add_tensor(kind.name.lower(), quantize(rows, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_field_and_tensor_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = _write_every_kind(tmp_path / "every.gguf")
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        expected = theirs.fields[key].contents()
        assert ours.fields[key] == expected and type(ours.fields[key]) is type(expected), key
    assert ours.fields["t.text"] == "héllo 世界 🙂" and ours.fields["t.u64"] == 2**63 + 5
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape.tolist() == reference.shape.tolist(), mine.name
        assert mine.data.dtype == reference.data.dtype, mine.name
        assert mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
    assert {t.tensor_type for t in ours.tensors} == {Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1}


@pytest.mark.parametrize("keep", [0.02, 0.3, 0.97])
def test_a_cut_file_is_refused(tmp_path: Path, keep: float) -> None:
    path = _write_every_kind(tmp_path / "every.gguf")
    whole = path.read_bytes()
    path.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(ValueError):
        read_gguf(path)


def test_another_format_is_refused_by_its_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf" * 4)
    with pytest.raises(ValueError, match="magic"):
        read_gguf(path)
