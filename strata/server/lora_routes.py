"""LoRA adapters loaded and unloaded while the instance serves (vLLM's routes and bodies).

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"[, "sha256"]}: 200; the same files
                                   again: 200, nothing changes; a name served with other weights
                                   is replaced; files whose digest is not `sha256`: 400
    POST /v1/unload_lora_adapter   {"lora_name"}: 200; a name not served: 404

Both take the admin key or the fleet's internal key (openapi_routes.py): a gateway's release
controller loads and unloads registered adapter versions
(strata/registry/releases/adapter_steps.py). The instance's table of names is `LoraTable`
(loras.py: which adapters are known, which resident, who holds them), which changes it one
change at a time. A load (making room first under --max-cpu-loras) reads and checks the files off
the event loop (the `LoraLoader` `strata serve` gives: strata.model.lora.load_adapter against
the base), hands the adapter to the engine thread between two steps, then maps the name. An
unload (or a replacement) unmaps the name at once, then retires the old digest on the engine
thread: requests admitted before finish on those weights, which are freed when the last of them
ends; later requests for the name get 404 (strata/engine/loras.py). Since every block name holds
the digest, a name reloaded with other weights never hits the old weights' KV.

A bad path or adapter is a 400 with the `LoraError`'s message, as is the base model's own name
and an instance that cannot load adapters (simulated or an encoder).
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from strata.protocol.lora import (
    LOAD_PATH,
    UNLOAD_PATH,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from strata.server.loras import LoraLoader, LoraTable
from strata.server.preamble import parse_body


def lora_table(request: Request) -> LoraTable:
    table: LoraTable = request.app.state.loras
    return table


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse_body(request, LoadLoraAdapterRequest)
    changed = await lora_table(request).load(body.lora_name, body.lora_path, body.sha256)
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
