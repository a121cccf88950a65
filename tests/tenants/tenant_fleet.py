"""One simulated instance behind two real gateways that share one usage store (a real Redis),
keyed: the fleet of the tenants tests. Each fleet's keys are new (a uuid), so its tenants are
its own in the suite's shared Redis."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from live_fleet import ServedApp, serve_gateway
from sim_instances import SimInstance, start_sim_instance

from strata.protocol.keys import auth_header, tenant_of_key

MODEL = "sim"


@dataclass
class TenantFleet:
    instance: SimInstance
    gateways: list[ServedApp]
    keys: dict[str, str]  # name -> client key
    admin_key: str

    def tenant(self, name: str) -> str:
        return tenant_of_key(self.keys[name])

    def headers(self, name: str) -> dict[str, str]:
        return auth_header(self.keys[name])

    def usage(self, gateway: int = 0, **params: str) -> httpx.Response:
        return httpx.get(f"{self.gateways[gateway].url}/admin/usage", params=params,
                         headers=auth_header(self.admin_key), timeout=10)

    def instance_finished(self) -> float:
        """Requests the instance finished (its strata:request_success_total)."""
        text = httpx.get(f"{self.instance.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("strata:request_success_total{"))


@contextlib.contextmanager
def tenant_fleet(tmp: Path, redis_url: str, key_lines: dict[str, str],
                 *flags: str) -> Iterator[TenantFleet]:
    """`key_lines`: name -> what follows the key on its key-file line ("", "rpm=3", ...)."""
    run = uuid.uuid4().hex[:8]
    keys = {name: f"sk-{name}-{run}" for name in key_lines}
    (tmp / "client.keys").write_text("".join(f"{keys[n]} {rest}\n" for n, rest in
                                             key_lines.items()))
    admin_key = f"admin-{run}"
    (tmp / "admin.keys").write_text(admin_key + "\n")
    instance = start_sim_instance(model=MODEL)
    gateways: list[ServedApp] = []
    try:
        for _ in range(2):
            gateways.append(serve_gateway([
                "--instances", instance.url, "--usage-store", redis_url,
                "--api-key-file", str(tmp / "client.keys"),
                "--admin-key-file", str(tmp / "admin.keys"), *flags]))
        yield TenantFleet(instance, gateways, keys, admin_key)
    finally:
        for gateway in gateways:
            gateway.stop()
        instance.stop()


def chat(max_tokens: int, prompt: str, *, stream: bool = False,
         include_usage: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": prompt}]}
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    return body


def usage_of(answer: httpx.Response) -> dict[str, Any] | None:
    """The usage an answer carried: a JSON body's, or a stream's usage chunk (None: none)."""
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        found = answer.json().get("usage")
        return found if isinstance(found, dict) else None
    usage = None
    for line in answer.text.splitlines():
        if line.startswith("data: {"):
            found = json.loads(line[6:]).get("usage")
            usage = found if isinstance(found, dict) else usage
    return usage
