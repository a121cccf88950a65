"""Where Strata keeps what it caches on this machine: pulled models, dequantized weights, built
C kernels. One rule for every layer (the CLI, the model loader, the kernel build)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def cache_dir_from_env(env: Mapping[str, str]) -> Path:
    """STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    if env.get("STRATA_CACHE_DIR"):
        return Path(env["STRATA_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "strata"
    return Path.home() / ".cache" / "strata"


def kernel_cache_dir(env: Mapping[str, str]) -> Path:
    """STRATA_KERNEL_CACHE_DIR, else `kernels/` in the cache directory."""
    if env.get("STRATA_KERNEL_CACHE_DIR"):
        return Path(env["STRATA_KERNEL_CACHE_DIR"]).expanduser()
    return cache_dir_from_env(env) / "kernels"


__all__ = ["cache_dir_from_env", "kernel_cache_dir"]
