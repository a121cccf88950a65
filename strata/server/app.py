"""The instance server's HTTP app: the OpenAI API over one engine. Routes only translate.

    POST /v1/completions, /v1/chat/completions   generation_routes.py (SSE when stream=true)
    POST /v1/embeddings                           embeddings.py (an instance of --task embed)
    GET  /v1/sessions, GET|DELETE /v1/sessions/{id}   session_routes.py (sessions.py)
    GET  /v1/models, /health, /ready, /metrics, /load   info_routes.py
    GET  /v1/strata/kv-events, /v1/strata/tokenizer     prefix_routes.py (cache-aware gateways)
    POST /tokenize, /detokenize, /admin/drain           info_routes.py
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   lora_routes.py (the admin key)
    /internal/prefill/..., /internal/decode/..., /internal/kv/...   pd/routes.py (hand-off)
    POST /v1/strata/resume                        resume.py: go on with a stream another
                                                  instance began (strata/protocol/resume.py)

Every route reaches the instance's parts through one typed object (`Instance`, instance.py);
every error leaves through one table (errors.py). Middleware, outermost first: `X-Request-Id`
(`strata.protocol.request_id`), API keys (`strata.protocol.auth`: each route takes the kinds
of key its OpenAPI row documents; the fleet's own routes only the internal key), `X-Model-Version`,
the body limit (body_limit.py).

Draining (`Instance.is_draining`, set by POST /admin/drain, by `strata serve` as soon as it is
told to stop, or by the lifespan shutdown): new requests get 503 with Retry-After while in-flight
ones finish. uvicorn's graceful shutdown waits for open connections before the lifespan shutdown
stops the engine, so streams in flight complete. With a `Registration`, the lifespan keeps the
instance in the registry; a drain reports DRAINING and deregisters once no request is in flight.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI
from starlette.routing import BaseRoute

from strata import tracing
from strata.protocol.auth import ApiKeyAuth
from strata.protocol.pd import KV_PATH, LAYOUT_PATH
from strata.protocol.request_id import RequestIdMiddleware
from strata.server.async_engine import AsyncEngine
from strata.server.body_limit import BodyLimitMiddleware, ModelVersionHeader
from strata.server.config import ServerConfig
from strata.server.embeddings import embedding_routes
from strata.server.errors import install_error_handlers
from strata.server.generation_routes import generation_routes
from strata.server.info_routes import info_routes
from strata.server.instance import Instance
from strata.server.kv_events import open_prefix_serving
from strata.server.kv_offload import open_kv_offload
from strata.server.lora_routes import lora_routes
from strata.server.loras import LeaseRelease, LoraLoader, LoraTable
from strata.server.metrics import ServerMetrics
from strata.server.openapi_routes import instance_access, instance_openapi
from strata.server.pd.routes import pd_routes
from strata.server.pd.state import PD
from strata.server.prefix_routes import prefix_routes
from strata.server.registration import Registration, with_adapters
from strata.server.resume import resume_routes
from strata.server.serving import ServingContext
from strata.server.session_routes import session_routes
from strata.server.sessions import Sessions
from strata.server.translate import ServerTokenizer
from strata.state.kv_store import KVStore
from strata.state.sessions import SessionStore, WriteBehindSessionStore, create_session_store

# the paths whose requests are traced: a client's work and the hand-off's calls (not health,
# metrics or the gateways' long polls of KV events)
TRACED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                   "/v1/strata/resume", "/internal/", "/tokenize", "/detokenize")


def create_app(async_engine: AsyncEngine, tokenizer: ServerTokenizer, config: ServerConfig,
               *, registration: Registration | None = None,
               session_store: SessionStore | None = None,
               kv_store: KVStore | None = None,
               lora_loader: LoraLoader | None = None,
               lora_bytes: Mapping[str, int] | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine`; starts the engine thread.

    With `registration`, the lifespan registers the instance, heartbeats and deregisters it.
    Sessions use `session_store`, else the lifespan opens (and closes) the store named by
    `config.session_store_url`; with neither, a request with a session id is a 400.
    With `config.kv_offload`, KV blocks go to `kv_store` or the store `config.kv_store_url`
    names (kv_offload.py); the lifespan closes it. `lora_loader` reads a LoRA adapter for
    POST /v1/load_lora_adapter and for adapters loaded on demand (None: the route answers 400);
    `lora_bytes` (by digest) sizes the adapters already resident, for /metrics."""
    async_engine.start()
    metrics = ServerMetrics(config.served_model_name, simulated=config.simulated)
    instance = Instance(ServingContext(async_engine, tokenizer, config, metrics), registration)
    instance.prefix = open_prefix_serving(async_engine.engine, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            pd.start()
            stack.push_async_callback(pd.close)
            _open_parts(instance, stack, session_store, kv_store)
            yield

    app = FastAPI(title="Strata", routes=build_routes(), lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.instance = instance
    app.state.pd = pd = PD(instance, config.pd)
    app.state.loras = LoraTable(async_engine, config, lora_loader, metrics.lora, lora_bytes)
    if registration is not None:  # heartbeats carry the adapters' residency (gateway placement)
        registration.load_fn = with_adapters(registration.load_fn, app.state.loras.residency)
    app.openapi = instance_openapi  # type: ignore[method-assign]  # built at its first GET
    app.add_middleware(LeaseRelease, table=lambda: app.state.loras)  # after the answer's end
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(ModelVersionHeader,
                       value=f"{config.served_model_name}@{config.model_version}")
    if config.api_keys or config.admin_keys or config.internal_keys:
        app.add_middleware(ApiKeyAuth, keys=list(config.api_keys),
                           admin_keys=list(config.admin_keys),
                           internal_keys=list(config.internal_keys), access=instance_access(),
                           rate_limit_per_s=config.rate_limit_per_s,
                           max_priority=dict(config.key_max_priority))
    if tracing.is_on():  # the request's span, its parent the caller's `traceparent`
        app.add_middleware(tracing.TraceRequests, component="strata.instance",
                           traced_prefixes=TRACED_PREFIXES,
                           attributes={"strata.model": f"{config.served_model_name}@"
                                                       f"{config.model_version}"},
                           route_of=span_route)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer and log line has the id
    install_error_handlers(app)
    return app


def span_route(path: str) -> str:
    """A request's span name: its path, or for a hand-off's blocks the route's template."""
    if path.startswith(KV_PATH + "/") and path != LAYOUT_PATH:
        return KV_PATH + "/{handle}"
    return path


def build_routes() -> list[BaseRoute]:
    return [*generation_routes(), *embedding_routes(), *session_routes(), *info_routes(),
            *prefix_routes(), *pd_routes(), *resume_routes(), *lora_routes()]


def _open_parts(instance: Instance, stack: AsyncExitStack, session_store: SessionStore | None,
                kv_store: KVStore | None) -> None:
    """Open what the lifespan owns; `stack` closes it in reverse order at shutdown: the engine
    stops (after the drain), the registration ends, then the session store (streams that
    finished during the drain have stored their turn) and the KV store close."""
    config, engine = instance.config, instance.engine
    kv = instance.serving.kv_offload = open_kv_offload(config, engine.engine,
                                                       instance.metrics.kv, kv_store)
    if kv is not None:
        stack.push_async_callback(kv.close, config.shutdown_timeout_s)
    if session_store is None and config.session_store_url is not None:
        session_store = create_session_store(
            config.session_store_url, redis_appendfsync=config.session_redis_appendfsync,
            redis_replicas=config.session_redis_replicas,
            consistency=config.session_consistency, flush_bound_s=config.session_flush_bound_s,
            max_pending=config.session_write_queue)
        stack.push_async_callback(session_store.close)  # a write-behind flushes first
    if session_store is not None:
        instance.sessions = Sessions(session_store, config, engine.max_model_len,
                                    instance.tokenizer)
        if isinstance(session_store, WriteBehindSessionStore):
            instance.metrics.watch_session_writes(session_store.stats)
    if instance.registration is not None:
        instance.registration.start()
        stack.push_async_callback(instance.registration.stop)
    stack.push_async_callback(instance.stop)


__all__ = ["build_routes", "create_app"]
