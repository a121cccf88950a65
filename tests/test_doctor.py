"""`strata doctor`: the real command on this machine (it must agree with what the test can see
for itself), and each check's reasons over fake machines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from strata.commands.doctor import format_text, report
from strata.commands.doctor_checks import (
    CudaInfo,
    MatmulKernels,
    Probe,
    packages_by_extra,
    run_checks,
)
from strata.model.fetch import KNOWN_MODELS, cached_model_path
from strata.model.kernel_build import KernelBuild, compile_kernels

PARTS = ["ray", "redis_client", "redis_server", "c_kernels", "cuda", "default_model", "chromium"]


def _doctor(cache_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STRATA_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "strata.cli", "doctor", *flags], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_doctor_json_agrees_with_this_machine(tmp_path: Path) -> None:
    done = _doctor(tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    parts = {p["name"]: p for p in found["parts"]}
    assert list(parts) == PARTS
    assert found["cache_dir"] == str(tmp_path)
    # the test environment has the dev extra: doctor reads the same versions
    assert found["packages"]["dev"]["pytest"] == metadata.version("pytest")
    assert found["packages"]["base"]["torch"] == metadata.version("torch")
    assert set(found["packages"]) == {"base", "ray", "dev"}
    assert parts["ray"]["usable"] is (importlib.util.find_spec("ray") is not None)
    import torch

    assert parts["cuda"]["usable"] is torch.cuda.is_available()
    assert parts["c_kernels"]["usable"] is compile_kernels().is_built
    assert parts["default_model"]["usable"] is False  # an empty cache
    assert "strata models pull" in parts["default_model"]["detail"]
    from strata.model import gemm

    kernels = {"AMX tiles": gemm.has_amx(), "AVX512-BF16 vector": gemm.supports_bf16(),
               "portable": gemm.supports_quantized() and not gemm.supports_bf16()}
    assert found["matmul"]["kernels"] == [name for name, runs in kernels.items() if runs]
    assert found["matmul"]["batch_invariant"] is not (gemm.has_amx() or gemm.supports_bf16())


def test_doctor_text_lists_every_part_and_sees_a_cached_model(tmp_path: Path) -> None:
    model = cached_model_path(KNOWN_MODELS["smollm2"], tmp_path)
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF" * 1000)
    done = _doctor(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("strata 0.1.0 (Python ")
    assert "installed:" in lines and "optional parts:" in lines
    assert any(line.startswith("  dev   all ") for line in lines)
    start = lines.index("optional parts:") + 1
    parts = lines[start:lines.index("", start)]
    titles = ["Ray", "Redis client", "redis-server", "C kernels", "CUDA", "default model",
              "chromium"]
    assert [line.split("] ")[1].split("  ")[0].strip() for line in parts] == titles
    model_line = parts[titles.index("default model")]
    assert model_line.startswith("  [ok] default model") and str(model) in model_line
    assert lines[-2].startswith("matmul kernels: ")


def _bare_machine(tmp_path: Path, **overrides: object) -> Probe:
    """A machine with strata's base only: no Ray, no Redis, no compiler, a CPU torch."""
    versions = {"torch": "2.13.0+cpu", "fastapi": "0.1"}
    fields: dict[str, object] = {
        "cache_dir": tmp_path, "version": versions.get, "which": lambda name: None,
        "run": lambda cmd: None, "kernels": lambda: KernelBuild(None, None),
        "cuda": lambda: CudaInfo("2.13.0+cpu", None),
        "matmul": lambda: MatmulKernels(is_built=False, has_bf16=False, has_amx=False),
        "requires": lambda: ["torch==2.13.0", "fastapi>=0.110", 'ray>=2.40; extra == "ray"',
                             'pytest>=8; extra == "dev"', 'moto[server]>=5; extra == "dev"'],
    }
    return Probe(**{**fields, **overrides})  # type: ignore[arg-type]


def _details(probe: Probe) -> dict[str, tuple[bool, str]]:
    return {p.name: (p.is_usable, p.detail) for p in run_checks(probe)}


def test_on_a_bare_machine_every_part_says_why_not_and_what_to_do(tmp_path: Path) -> None:
    details = _details(_bare_machine(tmp_path))
    assert [usable for usable, _ in details.values()] == [False] * len(PARTS)
    assert "pip install 'strata[ray]'" in details["ray"][1]
    assert "pip install redis" in details["redis_client"][1]
    assert "apt-get install redis-server" in details["redis_server"][1]
    assert "no C compiler" in details["c_kernels"][1]
    assert "torch 2.13.0+cpu is a CPU build" in details["cuda"][1]
    assert "strata models pull" in details["default_model"][1]
    assert "apt-get install -y --no-install-recommends chromium" in details["chromium"][1]
    found = report(_bare_machine(tmp_path))
    assert found["packages"] == {"base": {"torch": "2.13.0+cpu", "fastapi": "0.1"},
                                 "ray": {"ray": None}, "dev": {"pytest": None, "moto": None}}
    text = format_text(found)
    assert "  ray   not installed (ray): pip install 'strata[ray]'" in text
    assert "  dev   not installed (pytest, moto): `make test`, or pip install -e '.[dev]'" in text


def test_a_failed_kernel_build_and_an_invisible_gpu_are_told_apart(tmp_path: Path) -> None:
    probe = _bare_machine(
        tmp_path, kernels=lambda: KernelBuild(None, "/usr/bin/cc", "x.c:1: error: no omp.h"),
        cuda=lambda: CudaInfo("2.13.0", "12.8"))
    details = _details(probe)
    assert details["c_kernels"] == (False, "/usr/bin/cc failed to build them (the torch paths "
                                           "are used): x.c:1: error: no omp.h")
    assert details["cuda"][1].startswith("torch 2.13.0 (CUDA 12.8) sees no GPU")
    gpu = _details(_bare_machine(tmp_path, cuda=lambda: CudaInfo("2.13.0", "12.8", ("H200",))))
    assert gpu["cuda"] == (True, "torch 2.13.0 (CUDA 12.8): 1 device(s): H200")


def test_found_binaries_are_run_and_a_check_that_raises_is_reported(tmp_path: Path) -> None:
    paths = {"redis-server": "/usr/bin/redis-server", "chromium": "/usr/bin/chromium"}
    said = {"/usr/bin/redis-server": "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc"}

    def broken_kernels() -> KernelBuild:
        raise OSError("libgomp.so.1: cannot open shared object file")

    details = _details(_bare_machine(
        tmp_path, which=paths.get, run=lambda cmd: said.get(cmd[0]), kernels=broken_kernels,
        version={"redis": "5.0", "playwright": "1.45", "ray": "2.40.0"}.get))
    assert details["redis_server"] == (True, "/usr/bin/redis-server: redis-server 7.0.15")
    assert details["redis_client"] == (True, "redis 5.0")
    assert details["ray"][0] is True
    assert details["chromium"][0] is True
    assert details["c_kernels"] == (False, "the check failed: OSError: libgomp.so.1: cannot "
                                           "open shared object file")


def test_requirements_group_by_extra_and_skip_strata_itself() -> None:
    groups = packages_by_extra(
        ["numpy>=1.26", 'strata[ray]; extra == "dev"', "ray>=2.40 ; extra == 'ray'",
         'moto[server]>=5; extra == "dev"'], {"numpy": "2.0"}.get)
    assert groups == {"base": {"numpy": "2.0"}, "ray": {"ray": None}, "dev": {"moto": None}}


@pytest.mark.parametrize("flag", [[], ["--json"]])
def test_doctor_exits_0_even_when_nothing_optional_is_usable(tmp_path: Path,
                                                             flag: list[str]) -> None:
    env_path = tmp_path / "bin"
    env_path.mkdir()
    env = {**os.environ, "STRATA_CACHE_DIR": str(tmp_path), "PATH": str(env_path)}
    done = subprocess.run([sys.executable, "-m", "strata.cli", "doctor", *flag], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "no C compiler" in done.stdout
    assert "no C kernels: torch's matmuls at every batch size" in done.stdout


@pytest.mark.parametrize(("kernels", "names", "is_invariant", "says"), [
    (MatmulKernels(True, True, True), ["AMX tiles", "AVX512-BF16 vector"], False,
     "`strata serve` runs one kernel at every size by default for quantized weights "
     "(--no-deterministic: faster on one stream), for bf16 weights with --deterministic only"),
    (MatmulKernels(True, True, False), ["AVX512-BF16 vector"], False,
     "bf16 weights above 64 rows run oneDNN, so by default a bf16 model's tokens can depend on "
     "its batch; `strata serve --deterministic`"),
    (MatmulKernels(True, False, False), ["portable"], True,
     "one kernel at every batch size, so a request's tokens do not depend on its batch"),
    (MatmulKernels(False, False, False), [], True, "no C kernels"),
])
def test_doctor_names_the_matmul_kernels_and_whether_tokens_can_depend_on_the_batch(
        tmp_path: Path, kernels: MatmulKernels, names: list[str], is_invariant: bool,
        says: str) -> None:
    found = report(_bare_machine(tmp_path, matmul=lambda: kernels))
    assert found["matmul"]["kernels"] == names
    assert found["matmul"]["batch_invariant"] is is_invariant
    assert says in found["matmul"]["detail"]
    assert ("--deterministic" in found["matmul"]["detail"]) is not is_invariant
    lines = format_text(found).splitlines()
    assert lines[-2:] == [f"matmul kernels: {', '.join(names) or 'none'}",
                          f"  {found['matmul']['detail']}"]
