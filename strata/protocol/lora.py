"""The bodies of an instance's LoRA admin routes, as vLLM's (POST /v1/load_lora_adapter,
POST /v1/unload_lora_adapter; strata/server/lora_routes.py). Both answer 200 with a line of
text, as vLLM does."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's clients may send `load_inplace`

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)  # a directory on the instance


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's `lora_int_id` is not used

    lora_name: str = Field(min_length=1, max_length=256)


__all__ = ["LOAD_PATH", "UNLOAD_PATH", "LoadLoraAdapterRequest", "UnloadLoraAdapterRequest"]
