"""Builds Strata's C libraries (shipped as package data in `csrc/`) and loads them: the CPU
kernels (`cpu_kernels.c`) and the shared-memory collectives of tensor parallel (`shm_comm.c`).

The library is compiled at first use with the system C compiler (about 2.5 s of CPU for the
kernels at -O3) and loaded with ctypes; it links `libgomp.so.1` by soname, so it shares torch's
already-loaded OpenMP runtime and thread count. The outcome is built once per process and kept
(`kernels()`, `shm_collectives()`), and a library that built is kept on disk too, in the kernel
cache that the process's entry point names (`use_cache_dir`: `strata` itself names
`kernels/` of its cache directory, strata/cache_dirs.py, and a parallel instance hands its own to
its ranks in their spec; a process that names none compiles), under a key of everything the
build depends on: the sources (the C file and every header beside it), the flags, the compiler
(its path, size and time) and, since `-march=native` builds for the CPU it runs on, the CPU's
model and feature flags. Every later process on that machine (each instance, each parallel
rank) loads the cached library instead of compiling again; a cache entry that does not load is
built again and replaced. Entries are written whole (a private name, then a rename), so
processes building at once never load a half-written file; a cache that cannot be written
leaves the build in a temporary directory, as before.

Fallback rules: with no C compiler, or when compiling fails, there is no library and the model
uses its torch paths (a warning says which). `KernelBuild` keeps the two cases apart, so that
tests skip only when no compiler exists and fail, with the compiler's message, when one exists
but cannot build the kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
TYPE_SUFFIXES = ("bf16", "f32")  # decode_<suffix>, decode_<suffix>_chunk, ..._add_rms_norm
SHM_SOURCE = SOURCE.with_name("shm_comm.c")
SHM_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")  # no fast-math: sums keep their order


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """What building the kernels gave: the library, or why there is none."""

    library: ctypes.CDLL | None
    compiler: str | None  # None: no C compiler on PATH
    error: str = ""  # the compiler's message when it failed

    @property
    def is_built(self) -> bool:
        return self.library is not None


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def compile_kernels(source: Path = SOURCE, compiler: str | None = None) -> KernelBuild:
    """Compile `source` (and the headers beside it) and load the library; never raises for a
    failed build."""
    return compile_library(source, _declare_all, FLAGS, compiler,
                           fallback="attention and norms use the slower torch paths")


def compile_library(source: Path, declare: Callable[[ctypes.CDLL], None],
                    flags: tuple[str, ...], compiler: str | None = None, *,
                    fallback: str) -> KernelBuild:
    """Compile one C file into a loaded library; `fallback` says what runs without it."""
    cc = compiler or find_compiler()
    if cc is None:
        log.warning("no C compiler found: %s", fallback)
        return KernelBuild(None, None)
    cached = (_cache_dir / f"{source.stem}-{build_key(source, flags, cc)}.so"
              if _cache_dir is not None else None)
    handle = _load_cached(cached) if cached is not None else None
    if handle is None:
        # The directory goes once the library is loaded: the mapping outlives the file.
        with tempfile.TemporaryDirectory(prefix="strata-kernels-") as tmp:
            lib = Path(tmp) / f"{source.stem}.so"
            cmd = [cc, *flags, str(source), "-o", str(lib), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                error = done.stderr.strip() or f"{cc} exited with {done.returncode}"
                log.warning("compiling %s failed (%s); %s", source.name, error[-500:], fallback)
                return KernelBuild(None, cc, error)
            handle = ctypes.CDLL(str(lib))
            if cached is not None:
                _keep(lib, cached)
    declare(handle)
    return KernelBuild(handle, cc)


_cache_dir: Path | None = None


def use_cache_dir(path: Path | None) -> None:
    """Keep and look for built libraries in `path` from now on in this process (None: none)."""
    global _cache_dir
    _cache_dir = path


def cache_dir() -> Path | None:
    """The kernel cache this process uses, to hand on to the processes it starts."""
    return _cache_dir


def build_key(source: Path, flags: tuple[str, ...], compiler: str) -> str:
    """What a built library depends on, hashed: the sources, flags, compiler and CPU."""
    digest = hashlib.sha256()
    for path in [source, *sorted(source.parent.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    cc = Path(shutil.which(compiler) or compiler).resolve()
    stat = cc.stat() if cc.exists() else None
    digest.update(repr((flags, str(cc), stat and (stat.st_size, stat.st_mtime_ns))).encode())
    digest.update(_cpu_signature())
    return digest.hexdigest()[:24]


def _cpu_signature() -> bytes:
    """The first CPU's model and feature flags: what `-march=native` compiles for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b"no /proc/cpuinfo"
    wanted = ("model name", "flags", "Features", "CPU part")  # x86 and Arm spellings
    lines = [line for line in text.split("\n\n", 1)[0].splitlines() if line.startswith(wanted)]
    return "\n".join(lines).encode()


def _load_cached(path: Path) -> ctypes.CDLL | None:
    if not path.exists():
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:  # cut short or foreign: built again and replaced
        log.warning("the cached kernel library %s does not load (%s); building it again", path, e)
        return None


def _keep(lib: Path, cached: Path) -> None:
    """Copy a library that built into the cache, whole or not at all."""
    partial = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.copyfile(lib, partial)
        os.replace(partial, cached)
    except OSError as e:
        log.info("the kernel library is not cached (%s): the next process builds it again", e)
        with contextlib.suppress(OSError):
            partial.unlink()


def _declare_all(handle: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix in TYPE_SUFFIXES:
        name = f"decode_{suffix}"
        _declare(handle, name, [ptr] * 7 + [i64] * 7 + [ctypes.c_float])
        _declare(handle, f"{name}_add_rms_norm", [ptr] * 4 + [i64] * 2 + [ctypes.c_float])
        _declare(handle, f"{name}_chunk", [ptr] * 6 + [i64] * 7 + [ctypes.c_float])
        _declare(handle, f"{name}_lanes", [ptr] * 7 + [i64] * 7 + [ctypes.c_float])
    i32 = ctypes.c_int
    _declare(handle, "gemm_pack_q", [i32, ptr, i64, i64, ptr])
    _declare(handle, "gemm_pack_bf16", [ptr, i64, i64, ptr])
    _declare(handle, "gemm_rows_q", [i32, ptr, i64, i64, ptr, i64, ptr])
    _declare(handle, "gemm_q", [i32, ptr, i64, i64, ptr, i64, ptr, ptr])
    _declare(handle, "gemm_q_portable", [i32, ptr, i64, i64, ptr, i64, ptr, ptr])
    _declare(handle, "gemm_bf16", [ptr, i64, i64, ptr, i64, ptr, ptr])
    _declare(handle, "gemm_amx", [i32, ptr, i64, i64, ptr, i64, ptr, ptr])
    for name in ("gemm_has_bf16", "gemm_amx_init", "kv_crc32_folds"):
        getattr(handle, name).argtypes = []
        getattr(handle, name).restype = i32
    u32 = ctypes.c_uint32
    handle.kv_crc32.argtypes, handle.kv_crc32.restype = [ptr, i64, u32], u32
    handle.kv_copy_crc32.argtypes = [ptr, i64, ptr, i64, i64, i64, u32]
    handle.kv_copy_crc32.restype = u32


def _declare(handle: ctypes.CDLL, name: str, argtypes: list) -> None:
    fn = getattr(handle, name)
    fn.argtypes = argtypes
    fn.restype = None


def _declare_shm(handle: ctypes.CDLL) -> None:
    ptr, i64, i32, text = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
    signatures: dict[str, tuple[list, object]] = {
        "shm_create": ([text, i32, i64, i32, i32], i32),
        "shm_attach": ([text, i32], ptr),
        "shm_detach": ([ptr], None),
        "shm_failed_rank": ([ptr], i32),
        "shm_abort": ([ptr, i32], None),
        "shm_wait_attached": ([ptr, i64], i32),
        "shm_barrier": ([ptr, i64], i32),
        "shm_all_reduce": ([ptr, ptr, i64, i32, i64], i32),
        "shm_gather_rows": ([ptr, ptr, i64, ptr, ptr, i32, i64], i32),
        "shm_broadcast_send": ([ptr, ptr, i64, i64], i32),
        "shm_broadcast_len": ([ptr, i32, i64], i64),
        "shm_broadcast_recv": ([ptr, i32, ptr, i64, i64], i32),
        "shm_send": ([ptr, i32, ptr, i64, i64], i32),
        "shm_recv_len": ([ptr, i32, i64], i64),
        "shm_recv": ([ptr, i32, ptr, i64, i64], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = argtypes, restype


_lock = threading.Lock()
_build: KernelBuild | None = None
_shm_build: KernelBuild | None = None


def kernels() -> KernelBuild:
    """The kernels of this process, built on first call (once, whatever the outcome)."""
    global _build
    with _lock:
        if _build is None:
            _build = compile_kernels()
    return _build


def kernel_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first call; None when they cannot be built."""
    return kernels().library


def built_kernel_library() -> ctypes.CDLL | None:
    """The kernels if this process has built them already, else None: never starts a build
    (a simulated instance or a gateway checks KV payloads with zlib rather than compile)."""
    with _lock:
        return _build.library if _build is not None else None


def shm_collectives() -> KernelBuild:
    """The shared-memory collectives of this process, built on first call (once)."""
    global _shm_build
    with _lock:
        if _shm_build is None:
            _shm_build = compile_library(SHM_SOURCE, _declare_shm, SHM_FLAGS,
                                         fallback="ranks on one host use torch.distributed")
    return _shm_build
