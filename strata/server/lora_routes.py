"""LoRA adapters loaded and unloaded while the instance serves (vLLM's routes and bodies).

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"}: 200; the same files again: 200,
                                   nothing changes; a name served with other weights is replaced
    POST /v1/unload_lora_adapter   {"lora_name"}: 200; a name not served: 404

Both take the admin key (openapi_routes.py). The instance's table of names is
`ServerConfig.loras` (name -> content digest), which requests read to pick their adapter and
which only `LoraTable` changes, one change at a time. A load reads and checks the files off
the event loop (the `LoraLoader` `strata serve` gives: strata.model.lora.load_adapter against
the base), hands the adapter to the engine thread between two steps, then maps the name. An
unload (or a replacement) unmaps the name at once, then retires the old digest on the engine
thread: requests admitted before finish on those weights, which are freed when the last of them
ends; later requests for the name get 404 (strata/engine/loras.py). Since every block name holds
the digest, a name reloaded with other weights never hits the old weights' KV.

A bad path or adapter is a 400 with the `LoraError`'s message, as is the base model's own name
and an instance that cannot load adapters (simulated, parallel or an encoder).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from strata.errors import InvalidRequestError, LoraError, ModelNotFoundError
from strata.protocol.lora import (
    LOAD_PATH,
    UNLOAD_PATH,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.preamble import parse_body

# (name, path) -> a strata.model.lora.LoraAdapter checked against the base; raises LoraError
LoraLoader = Callable[[str, str], Any]


class LoraTable:
    """The instance's adapters by name (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig,
                 loader: LoraLoader | None) -> None:
        self.engine = engine
        self.config = config
        self.loader = loader
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> bool:
        """Serve the adapter at `path` as `name`; False when it already did (same digest)."""
        if name == self.config.served_model_name:
            raise InvalidRequestError(f"lora_name {name!r} is the base model's name",
                                      param="lora_name")
        if self.loader is None:
            raise InvalidRequestError("this instance cannot load LoRA adapters (a simulated, "
                                      "parallel or embedding instance)", param="lora_path")
        try:
            adapter = await asyncio.to_thread(self.loader, name, path)
        except LoraError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from exc
        async with self._lock:
            old = self.config.loras.get(name)
            if old == adapter.digest:
                return False
            await self.engine.add_lora(adapter)
            self.config.loras[name] = adapter.digest
            if old is not None:
                await self._retire(old)
        return True

    async def unload(self, name: str) -> None:
        async with self._lock:
            digest = self.config.loras.pop(name, None)
            if digest is None:
                raise ModelNotFoundError(f"The LoRA adapter `{name}` is not loaded",
                                         param="lora_name")
            await self._retire(digest)

    async def _retire(self, digest: str) -> None:
        if digest not in self.config.loras.values():  # another name may serve the same files
            await self.engine.retire_lora(digest)


def lora_table(request: Request) -> LoraTable:
    table: LoraTable = request.app.state.loras
    return table


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse_body(request, LoadLoraAdapterRequest)
    changed = await lora_table(request).load(body.lora_name, body.lora_path)
    done = "added successfully" if changed else "was already loaded with these files"
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' {done}.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse_body(request, UnloadLoraAdapterRequest)
    await lora_table(request).unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def lora_routes() -> list[APIRoute]:
    return [APIRoute(LOAD_PATH, load_lora_adapter, methods=["POST"]),
            APIRoute(UNLOAD_PATH, unload_lora_adapter, methods=["POST"])]


__all__ = ["LoraLoader", "LoraTable", "lora_routes"]
