"""What the CLI read from the environment, handed to every command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CliEnv:
    cache_dir: Path  # pulled models, dequantized weights
    run_dir: Path  # `strata up`: registry database, logs, pid files
    api_keys: tuple[str, ...] = ()  # STRATA_API_KEYS, comma separated
    registry_url: str | None = None  # STRATA_REGISTRY
