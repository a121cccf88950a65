"""The instance's OpenAPI document (GET /openapi.json): the OpenAI operations of
strata/protocol/openapi.py and the instance's own."""

from __future__ import annotations

import functools
from typing import Any

from strata.protocol.auth import AccessTable
from strata.protocol.lora import (
    LOAD_PATH,
    UNLOAD_PATH,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from strata.protocol.openapi import OPENAI_OPERATIONS, Operation, openapi_document
from strata.protocol.resume import RESUME_PATH, ResumeRequest
from strata.server.pd.routes import PD_OPERATIONS

INSTANCE_OPERATIONS: tuple[Operation, ...] = (
    *OPENAI_OPERATIONS,
    Operation("GET", "/load", "The load the registry heartbeats carry", access="open"),
    Operation("POST", "/admin/drain", "Refuse new requests; deregister once idle", status=202,
              access="fleet"),
    Operation("GET", "/v1/strata/kv-events", "Prefix-cache events for cache-aware gateways",
              access="internal"),
    Operation("GET", "/v1/strata/tokenizer", "The tokenizer, for cache-aware gateways",
              access="internal"),
    Operation("POST", LOAD_PATH, "Load (or replace) a LoRA adapter from a path on the instance",
              LoadLoraAdapterRequest, access="fleet", media_type="text/plain"),
    Operation("POST", UNLOAD_PATH, "Unload a LoRA adapter (requests in flight finish on it)",
              UnloadLoraAdapterRequest, access="fleet", media_type="text/plain"),
    *PD_OPERATIONS,
    Operation("POST", RESUME_PATH, "Go on with a stream another instance began (gateways)",
              ResumeRequest, streams=True, access="internal"),
)


@functools.cache
def instance_openapi() -> dict[str, Any]:
    """The instance's OpenAPI document, built once, when first asked for (its schemas cost a
    quarter of a second of CPU that no start should pay)."""
    return openapi_document("Strata instance", INSTANCE_OPERATIONS)


def instance_access() -> AccessTable:
    """Who may call each route of the instance: its documented access."""
    return AccessTable.of_operations(INSTANCE_OPERATIONS)


__all__ = ["INSTANCE_OPERATIONS", "instance_access", "instance_openapi"]
