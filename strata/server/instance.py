"""One serving instance's parts in one typed object, and its drain.

    Instance
      serving        what generation needs: async engine, tokenizer, config, metrics, KV offload
                     (serving.ServingContext; `engine`, `tokenizer`, `config`, `metrics` below
                     read through to it)
      sessions       chat sessions over a session store (sessions.py), or None: sessions off
      registration   the instance's record in a registry (registration.py), or None
      prefix         its prefix cache's events and its tokenizer, for cache-aware gateways
                     (prefix_routes.py), or None
      is_draining    new requests get 503 + Retry-After; in-flight ones go on
      drain_task     after POST /admin/drain: reports DRAINING, deregisters once idle

`create_app` (app.py) builds it and keeps it in `app.state.instance`; every route reaches it
through `instance_of(request)`, as the gateway's routes reach their `Gateway`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from strata.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError, OverloadedError
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.kv_events import PrefixServing
from strata.server.metrics import ServerMetrics
from strata.server.registration import Registration
from strata.server.serving import ServingContext
from strata.server.sessions import Sessions
from strata.server.translate import ServerTokenizer


@dataclass(slots=True)
class Instance:
    """The parts of one instance (see the module docstring)."""

    serving: ServingContext
    registration: Registration | None = None
    sessions: Sessions | None = None  # set by the lifespan when a session store is configured
    prefix: PrefixServing | None = None  # set by create_app before the engine sees a request
    is_draining: bool = False
    drain_task: asyncio.Task[None] | None = None

    @property
    def engine(self) -> AsyncEngine:
        return self.serving.engine

    @property
    def tokenizer(self) -> ServerTokenizer:
        return self.serving.tokenizer

    @property
    def config(self) -> ServerConfig:
        return self.serving.config

    @property
    def metrics(self) -> ServerMetrics:
        return self.serving.metrics

    def admit(self, model_name: str | None) -> None:
        """Refuse when draining or dead, or for another model's name."""
        if self.is_draining:
            raise OverloadedError("the server is shutting down; retry on another instance",
                                  retry_after_s=self.config.retry_after_s, status_code=503)
        if not self.engine.is_healthy:
            raise EngineDeadError(self.engine.dead_reason or "the engine is not running")
        check_model(self.config, model_name)

    def require_task(self, task: str, route: str) -> None:
        """A 400 when this instance serves another task (an encoder generates nothing, a
        generative model is not served for embeddings)."""
        if self.config.task == task:
            return
        served = f"`{self.config.served_model_name}`"
        if task == "embed":
            raise InvalidRequestError(f"{route} needs an embedding model (an instance started "
                                      f"with --task embed); {served} is served here for "
                                      "generation", param="model")
        raise InvalidRequestError(f"{route} needs a generative model; {served} is served here "
                                  "for embeddings only (--task embed): use /v1/embeddings",
                                  param="model")

    def require_sessions(self) -> Sessions:
        """The sessions, or a 400 that says how to turn them on."""
        if self.sessions is None:
            raise InvalidRequestError("this server keeps no sessions; start it with "
                                      "--session-store URL (memory://, sqlite:///PATH, "
                                      "redis://...)", param="session_id")
        return self.sessions

    def begin_drain(self) -> None:
        """Refuse new requests; with a registration, report DRAINING and deregister once idle."""
        self.is_draining = True
        if self.registration is not None and self.drain_task is None:
            self.drain_task = asyncio.create_task(self._drain_registration(self.registration))

    async def _drain_registration(self, registration: Registration) -> None:
        poll_s = self.config.drain_poll_s
        await registration.drain()
        await asyncio.sleep(poll_s)  # lets a request admitted just before reach the engine
        while self.engine.num_in_flight and self.engine.is_healthy:
            await asyncio.sleep(poll_s)
        await registration.stop()

    async def stop(self) -> None:
        """The lifespan's shutdown (uvicorn has already waited for open connections): refuse new
        requests, report DRAINING, stop the engine (aborting what is left), let a drain end."""
        self.is_draining = True
        if self.registration is not None:
            await self.registration.drain()
        await self.engine.shutdown(self.config.shutdown_timeout_s)
        if self.drain_task is not None:  # ends now: the engine has no request left
            await self.drain_task


def check_model(config: ServerConfig, model_name: str | None) -> None:
    """`name` or `name@version` must be what this instance serves: never silently another."""
    served, version = config.served_model_name, config.model_version
    if model_name is not None and (model_name in config.loras or model_name in config.lora_paths):
        return  # a LoRA adapter over the base
    name, _, wanted = (model_name or served).partition("@")
    if name != served:
        raise ModelNotFoundError(f"The model `{model_name}` does not exist; this server serves "
                                 f"`{served}`", param="model")
    if wanted and wanted != version:
        raise ModelNotFoundError(f"Version `{wanted}` of `{served}` is not served here; this "
                                 f"instance serves `{served}@{version}`", param="model")


def instance_of(request: Request) -> Instance:
    """The instance serving `request` (every route's way to the parts)."""
    instance: Instance = request.app.state.instance
    return instance


__all__ = ["Instance", "check_model", "instance_of"]
