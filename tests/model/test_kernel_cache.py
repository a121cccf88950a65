"""The kernel cache (strata/model/kernel_build.py): a library that built is loaded by the next
process instead of compiled again; any change to what it was built from builds it anew; an entry
that does not load is built again and replaced. The compiler is a wrapper that counts its runs."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.model import kernel_build
from strata.model.kernel_build import compile_library

pytestmark = pytest.mark.needs("cc")

SOURCE = '#include "answer.h"\nint answer(void) { return ANSWER; }\n'


@pytest.fixture
def place(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(source, counting compiler, cache directory): the cache this process uses meanwhile."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "answer.c").write_text(SOURCE)
    (src / "answer.h").write_text("#define ANSWER 42\n")
    runs = tmp_path / "runs.log"
    wrapper = tmp_path / "cc-counting"
    wrapper.write_text(f'#!/bin/sh\necho run >> {runs}\nexec {shutil.which("cc")} "$@"\n')
    wrapper.chmod(0o755)
    cache, before = tmp_path / "kernels", kernel_build.cache_dir()
    kernel_build.use_cache_dir(cache)
    yield src / "answer.c", wrapper, cache
    kernel_build.use_cache_dir(before)


def build(source: Path, compiler: Path, flags: tuple[str, ...] = ("-O1",)) -> int:
    def declare(handle: ctypes.CDLL) -> None:
        handle.answer.restype = ctypes.c_int

    built = compile_library(source, declare, (*flags, "-shared", "-fPIC"), str(compiler),
                            fallback="none")
    assert built.library is not None, built.error
    return int(built.library.answer())


def runs(compiler: Path) -> int:
    log = compiler.with_name("runs.log")
    return len(log.read_text().split()) if log.exists() else 0


def test_a_process_that_names_no_cache_compiles_each_time(
        place: tuple[Path, Path, Path]) -> None:
    source, compiler, cache = place
    kernel_build.use_cache_dir(None)
    assert build(source, compiler) == 42 and build(source, compiler) == 42
    assert runs(compiler) == 2 and not cache.exists()


def test_a_second_build_loads_the_cached_library(place: tuple[Path, Path, Path]) -> None:
    source, compiler, cache = place
    assert build(source, compiler) == 42 and runs(compiler) == 1
    assert build(source, compiler) == 42 and runs(compiler) == 1  # no second compile
    assert [p.suffix for p in cache.iterdir()] == [".so"]  # one whole entry, no partial file
    assert oct(cache.stat().st_mode & 0o777) == "0o700"


def test_a_changed_header_or_flag_builds_anew(place: tuple[Path, Path, Path]) -> None:
    source, compiler, cache = place
    assert build(source, compiler) == 42
    source.with_name("answer.h").write_text("#define ANSWER 7\n")  # a header, not the .c
    assert build(source, compiler) == 7 and runs(compiler) == 2
    assert build(source, compiler, ("-O2",)) == 7 and runs(compiler) == 3
    assert len(list(cache.iterdir())) == 3


def test_an_entry_that_does_not_load_is_built_again(place: tuple[Path, Path, Path]) -> None:
    source, compiler, cache = place
    assert build(source, compiler) == 42
    [entry] = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # cut short
    assert build(source, compiler) == 42 and runs(compiler) == 2
    assert entry.stat().st_size > 100  # replaced whole
    assert build(source, compiler) == 42 and runs(compiler) == 2


def test_an_unwritable_cache_still_builds(place: tuple[Path, Path, Path],
                                          tmp_path: Path) -> None:
    source, compiler, _ = place
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    kernel_build.use_cache_dir(blocked / "kernels")
    assert build(source, compiler) == 42
    assert build(source, compiler) == 42 and runs(compiler) == 2  # nothing kept, built again
    assert not blocked.is_dir() and not any(p.name.startswith(".") for p in tmp_path.iterdir())
