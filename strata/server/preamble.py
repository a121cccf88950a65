"""The one door of the instance: every route that takes a client's request goes through it.

    instance, req = await client_request(request, ChatCompletionRequest, task="generate")

in this order, so that no route can skip a step:

  0. task    a generative route on an embed instance (or the reverse) is a 400, whatever the body
  1. parse   the hardened JSON reader (strata/protocol/json_body.py) into the wire model:
             anything else is a 400 through the error table
  2. tenant  the caller's tenant (the auth middleware's `Caller`: a client key's, or the one the
             gateway forwards with the internal key) goes into the request's `cache_salt`
             (translate.tenant_scoped):
             no prefix-cache or KV-store block is shared across tenants, except a leading system
             message sent with `share_system_prompt`; a server without client keys has one
             tenant, and the namespace is the request's own salt alone
  3. clamp   the priority is `X-Priority`, else the body's, else standard, clamped to the API
             key's ceiling (strata/protocol/priority.py)
  4. admit   refused while draining, when the engine is dead, or for another model's name
  5. task    again, for a request parsed by its route (resume)
  6. watch   the deadline: `X-Strata-Timeout-S`, else the body's `timeout` (seconds), from now
             (strata/protocol/deadline.py); the routes wait with cancel.unless_cancelled, which
             aborts the work when the client leaves or the deadline passes
  7. adapter a request naming a LoRA adapter holds it resident until its answer is sent,
             loading it first when --max-cpu-loras left it out (loras.py); the wait is bounded
             by the deadline and the client staying

The plain generation routes, embeddings, tokenize, the P/D hand-off's prefill and decode routes
and resume all enter here; a route whose body carries the client's request inside another
(resume) parses its own body with `parse_body`, then hands the inner request to `admitted`
and `hold_adapter`.
A check that every client request needs is added here, never in one route.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from strata.protocol.deadline import TIMEOUT_FIELD, TIMEOUT_HEADER
from strata.protocol.json_body import parse_json_object
from strata.protocol.pd import public_path
from strata.protocol.priority import MAX_PRIORITY_STATE, PRIORITY_HEADER, effective_priority
from strata.server import loras
from strata.server.cancel import unless_cancelled, watch
from strata.server.instance import Instance, instance_of
from strata.server.sessions import cache_tenant
from strata.server.translate import tenant_scoped

Task = Literal["generate", "embed", "any"]  # "any": both kinds of instance serve the route
M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON body -> model; a body that is not a JSON object (strata/protocol/json_body.py) and
    wrong types raise (mapped to 400)."""
    return model.model_validate(parse_json_object(await request.body()))


async def client_request(request: Request, model: type[M], *, task: Task) -> tuple[Instance, M]:
    """The instance and the client's request, parsed, scoped, clamped and admitted."""
    instance = instance_of(request)
    if task != "any":
        instance.require_task(task, public_path(request.url.path))
    body = admitted(request, instance, await parse_body(request, model), task=task)
    if task == "generate":  # tokenize and the like need no weights
        await hold_adapter(request, body)
    return instance, body


async def hold_adapter(request: Request, body: BaseModel) -> None:
    """Step 7, for a request `admitted` (a route that parses its own body calls it too)."""
    name = getattr(body, "model", None)
    table = request.app.state.loras
    if isinstance(name, str) and table.is_known(name):
        await unless_cancelled(request, loras.hold_adapter(request.scope, table, name))


def admitted(request: Request, instance: Instance, body: M, *, task: Task) -> M:
    """Steps 2-6 for a request already parsed: `body` in its tenant's namespace, its priority
    clamped, its deadline set; raises when the instance refuses it."""
    if "cache_salt" in type(body).model_fields:
        body = tenant_scoped(body, cache_tenant(request))
    if "priority" in type(body).model_fields:
        clamped: Any = body  # every model with the field: a completion's, a chat's, an embedding's
        clamped.priority = request_priority(request, clamped.priority)
    instance.admit(getattr(body, "model", None))
    if task != "any":
        instance.require_task(task, public_path(request.url.path))
    watch(request, request.headers.get(TIMEOUT_HEADER), getattr(body, TIMEOUT_FIELD, None),
          instance.serving.clock, instance.serving.metrics.observe_cancelled)
    return body


def request_priority(request: Request, body_priority: object) -> int:
    """`X-Priority`, else the body's `priority`, else standard; clamped to the API key's
    ceiling (strata/protocol/priority.py)."""
    ceiling = request.scope.get("state", {}).get(MAX_PRIORITY_STATE)
    return effective_priority(request.headers.get(PRIORITY_HEADER), body_priority, ceiling)


__all__ = ["Task", "admitted", "client_request", "parse_body", "request_priority"]
