"""The gateway's hands on an instance's LoRA adapters, for adapter releases and `AdapterSync`
(strata/registry/releases/adapter_steps.py, adapter_sync.py): the instance's own routes
(POST /v1/load_lora_adapter, /v1/unload_lora_adapter; strata/server/lora_routes.py) with the
fleet's internal key (else the first admin key), and one real completion for a warm-up.

A load carries the registered sha256, so the instance refuses files that are not the version's.
Every refusal raises with the instance's status and message, which the release records as its
reason for rolling back.
"""

from __future__ import annotations

import httpx

from strata.protocol.lora import LOAD_PATH, UNLOAD_PATH
from strata.registry.instances.records import InstanceRecord

WARM_PROMPT = "Hello"


class InstanceAdapters:
    """An `AdapterFleet` over HTTP."""

    def __init__(self, client: httpx.AsyncClient, *, timeout_s: float,
                 key: str | None = None) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def load(self, record: InstanceRecord, lora_name: str, path: str,
                   sha256: str) -> None:
        body: dict[str, object] = {"lora_name": lora_name, "lora_path": path,
                                   "sha256": sha256 or None}
        await self._post(record, LOAD_PATH, body, "loading")

    async def unload(self, record: InstanceRecord, lora_name: str) -> None:
        await self._post(record, UNLOAD_PATH, {"lora_name": lora_name}, "unloading",
                         not_served_is_fine=True)

    async def warm(self, record: InstanceRecord, lora_name: str) -> None:
        body: dict[str, object] = {"model": lora_name, "prompt": WARM_PROMPT, "max_tokens": 1,
                                   "temperature": 0}
        await self._post(record, "/v1/completions", body, "the warm-up request for")

    async def _post(self, record: InstanceRecord, path: str, body: dict[str, object],
                    what: str, *, not_served_is_fine: bool = False) -> None:
        response = await self.client.post(f"{record.url}{path}", json=body,
                                          headers=self.headers, timeout=self.timeout_s)
        if response.status_code == 200 or (not_served_is_fine and response.status_code == 404):
            return
        raise RuntimeError(f"{what} {body.get('lora_name') or body.get('model')} on "
                           f"{record.instance_id}: {response.status_code} "
                           f"{_message(response)}")


def _message(response: httpx.Response) -> str:
    """The OpenAI error body's message, else the start of the text."""
    try:
        return str(response.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


__all__ = ["InstanceAdapters"]
