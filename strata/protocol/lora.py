"""The bodies of an instance's LoRA admin routes, as vLLM's (POST /v1/load_lora_adapter,
POST /v1/unload_lora_adapter; strata/server/lora_routes.py). Both answer 200 with a line of
text, as vLLM does. And what an instance publishes of its adapters in its load report (registry
heartbeats and GET /load), which the gateway's `adapter_aware` policy reads:

    "adapters": [{"name": "sql", "digest": "9f1c...", "num_loads": 3, "num_evictions": 2,
                  "load_s": 0.071}, {"name": "chat"}, ...]

one entry per adapter the instance knows (it can load it on demand); `digest` is the content
digest of the weights resident now, absent (or null) when they are not; `load_s` the last
load's time; a field at its default (none, 0) is left out.

An adapter's identity is its name plus `adapter_digest`: the sha256 of its config then its
weights file. The instance names its KV blocks with it, the model registry records it for each
adapter version, and a load that carries `sha256` is refused unless the files read are those.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_digest(path: str | Path) -> str:
    """sha256 of the adapter's config then weights files (OSError when one is missing)."""
    root = Path(path)
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        h.update((root / name).read_bytes())
    return h.hexdigest()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's clients may send `load_inplace`

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)  # a directory on the instance
    # Strata's: the adapter_digest the files must have (a registered adapter version), or None
    sha256: str | None = Field(default=None, pattern="^[0-9a-f]{64}$")


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's `lora_int_id` is not used

    lora_name: str = Field(min_length=1, max_length=256)


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """One adapter an instance knows, as its load report carries it (see the module)."""

    name: str
    digest: str | None = None  # of the resident weights; None: known, not resident
    num_loads: int = 0
    num_evictions: int = 0
    load_s: float = 0.0  # the last load's time, file to engine (0: never loaded here)

    @property
    def is_resident(self) -> bool:
        return self.digest is not None

    def to_json(self) -> dict[str, Any]:
        """The fields that are not their defaults (a heartbeat lists every adapter known, most
        of them never loaded here: their entry is the name alone)."""
        body: dict[str, Any] = {"name": self.name}
        for key, value in (("digest", self.digest), ("num_loads", self.num_loads),
                           ("num_evictions", self.num_evictions), ("load_s", self.load_s)):
            if value:
                body[key] = value
        return body

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AdapterResidency:
        """The inverse of `to_json`; KeyError, ValueError or TypeError when it is not one."""
        digest = data.get("digest")
        return cls(str(data["name"]), None if digest is None else str(digest),
                   int(data.get("num_loads", 0)), int(data.get("num_evictions", 0)),
                   float(data.get("load_s", 0.0)))


def residency_of(entries: Any) -> tuple[AdapterResidency, ...]:
    """A load report's `adapters` list (absent: none); ValueError when it is not a list."""
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise ValueError(f"adapters: expected a list, got {type(entries).__name__}")
    return tuple(AdapterResidency.from_json(entry) for entry in entries)


__all__ = ["ADAPTER_FILES", "LOAD_PATH", "UNLOAD_PATH", "AdapterResidency",
           "LoadLoraAdapterRequest", "UnloadLoraAdapterRequest", "adapter_digest",
           "residency_of"]
