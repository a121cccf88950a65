"""Instances of the tiny model (float32, CPU) in this process, each a real uvicorn server on
127.0.0.1 with the hand-off routes, and the two calls a gateway makes for a hand-off. The fleet
shares INTERNAL_KEY: the hand-off routes take only it, and a decode instance follows only a
handle sealed with it (strata/server/pd/trust.py), as the gateway seals them."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

import httpx
from gateway_fakes import FixedSource
from live_fleet import ServedApp, serve_app
from live_server import metric, serve_in_thread

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelExecutor
from strata.gateway.app import create_gateway_app
from strata.gateway.config import AdmissionConfig, GatewayConfig, PDRoutingConfig
from strata.gateway.routing.instances import InstanceView
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel
from strata.protocol.pd import DECODE_PREFIX, HANDOFF_HEADER, PREFILL_PREFIX
from strata.protocol.seal import seal
from strata.server.app import create_app
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.pd.config import PDConfig

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
BLOCK = 8
CHAT = "/v1/chat/completions"
INTERNAL_KEY = "pd-fleet-internal-key"
FLEET = {"authorization": f"Bearer {INTERNAL_KEY}"}  # what the fleet's own calls carry


@dataclass
class Instance:
    url: str
    engine: Engine
    server: Any
    thread: Any
    app: Any = None

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when the labelled series is not there yet)."""
        return metric(self.url, name, **labels)

    @property
    def num_held_blocks(self) -> int:
        return self.engine.stats().num_held_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.engine.stats().num_free_blocks


def start_instance(model: LoadedModel, *, dtype: str = "float32", version: str = "v1",
                   num_blocks: int = 128, executor: ModelExecutor | None = None,
                   loras: dict[str, str] | None = None, **pd: Any) -> Instance:
    """An instance of `model` (a TorchExecutor unless `executor` is given: the caller shuts a
    given one down after `stop`); `loras` (name -> digest): the adapters `executor` holds."""
    loaded = model
    executor = executor or TorchExecutor(loaded.config, loaded.weights, dtype=dtype,
                                         model_name=MODEL, model_version=version)
    engine = Engine(executor,
                    CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                                namespace=f"{MODEL}@{version}"),
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                    max_model_len=MAX_MODEL_LEN),
                    loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    config = ServerConfig(served_model_name=MODEL, model_version=version, pd=PDConfig(**pd),
                          internal_keys=(INTERNAL_KEY,), loras=dict(loras or {}))
    app = create_app(AsyncEngine(engine, max_model_len=MAX_MODEL_LEN), loaded.tokenizer, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, thread = serve_in_thread(app, sock)
    return Instance(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, server, thread, app)


def start_gateway(roles: dict[str, tuple[str, str]], policy: str = "round_robin",
                  run_background: bool = False, start_wait_s: float = 60.0,
                  **pd: Any) -> ServedApp:
    """A real gateway over `roles` (instance id -> (URL, role)), disaggregating every prompt
    (`pd` overrides PDRoutingConfig); with `run_background`, its health checks and the prefix
    index's feed run."""
    views = [InstanceView(iid, url, MODEL, version="v1", role=role)  # start_instance's version
             for iid, (url, role) in roles.items()]
    config = GatewayConfig(port=0, policy=policy, read_timeout_s=60.0,
                           internal_keys=(INTERNAL_KEY,),
                           admission=AdmissionConfig(start_wait_s=start_wait_s),
                           pd=PDRoutingConfig(**{"mode": "auto", "min_uncached_tokens": 0, **pd}))
    control = httpx.AsyncClient(timeout=1.0)
    app = create_gateway_app(config, FixedSource(*views), control_client=control,
                             run_background=run_background)
    served = serve_app(app)
    served.gateway = app.state.gateway  # type: ignore[attr-defined]
    return served


def prefill(p: Instance, body: dict[str, Any], path: str = CHAT) -> str:
    """What the gateway does first: P's handle, with P's id and URL added and sealed (the
    header's value)."""
    response = httpx.post(f"{p.url}{PREFILL_PREFIX}{path}", json=body, headers=FLEET,
                          timeout=60)
    assert response.status_code == 200, response.text
    handle: dict[str, Any] = response.json() | {"url": p.url, "instance_id": "p"}
    return json.dumps(seal(handle, INTERNAL_KEY))


def decode(d: Instance, body: dict[str, Any], handle: str | None,
           path: str = CHAT) -> httpx.Response:
    """... then D, with the handle."""
    headers = FLEET | ({HANDOFF_HEADER: handle} if handle is not None else {})
    return httpx.post(f"{d.url}{DECODE_PREFIX}{path}", json=body, headers=headers, timeout=60)


def stream_decode(d: Instance, body: dict[str, Any], handle: str | None,
                  path: str = CHAT) -> list[dict[str, Any]]:
    headers = FLEET | ({HANDOFF_HEADER: handle} if handle is not None else {})
    return _events(httpx.post(f"{d.url}{DECODE_PREFIX}{path}", json={**body, "stream": True},
                              headers=headers, timeout=60))


def mixed(m: Instance, body: dict[str, Any], path: str = CHAT) -> httpx.Response:
    return httpx.post(f"{m.url}{path}", json=body, timeout=60)


def stream_mixed(m: Instance, body: dict[str, Any], path: str = CHAT) -> list[dict[str, Any]]:
    return _events(httpx.post(f"{m.url}{path}", json={**body, "stream": True}, timeout=60))


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    events = []
    for frame in response.text.split("\n\n"):
        data = frame.removeprefix("data: ").strip()
        if data and data != "[DONE]":
            events.append(json.loads(data))
    return events


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between any two answers (ids, times)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}
