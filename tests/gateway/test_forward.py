"""The request path (strata/gateway/path/forward.py) and the wiring around it (wiring.py): steps run
outermost first, one step per feature that is on, in the documented order; closing a gateway
closes every part it built, even when one close fails."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import httpx
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, view
from starlette.responses import Response

from strata.gateway.config import GatewayConfig, SessionRoutingConfig
from strata.gateway.path.forward import Handler, chain
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.proxy import ProxyRequest
from strata.gateway.wiring import Gateway, build_gateway
from strata.registry.models import create_model_registry
from strata.state.pins import MemoryPinStore

REQUEST = ProxyRequest("POST", "/v1/completions", b"{}", [], RouteRequest(), 0.0)


class Record:
    """A step that logs when the request passes it on the way in and out."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        self.log.append(f"{self.name} in")
        response = await call_next(request)
        self.log.append(f"{self.name} out")
        return response


class Refuse:
    """A step that answers by itself (as admission does when the queue is full)."""

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        return Response(b"refused", 429)


def test_steps_run_outermost_first_and_a_step_may_answer_without_the_rest() -> None:
    log: list[str] = []

    async def last(request: ProxyRequest) -> Response:
        log.append("proxy")
        return Response(b"ok")

    whole = chain([Record("a", log), Record("b", log)], last)
    assert asyncio.run(whole(REQUEST)).body == b"ok"
    assert log == ["a in", "b in", "proxy", "b out", "a out"]
    log.clear()
    cut = chain([Record("a", log), Refuse(), Record("b", log)], last)
    assert asyncio.run(cut(REQUEST)).status_code == 429
    assert log == ["a in", "a out"]


def steps_of(gateway: Gateway) -> list[str]:
    """The class names of the gateway's steps, outermost first, then the proxy's method."""
    names = []
    handler: Any = gateway.forward
    while isinstance(handler, functools.partial):
        names.append(type(handler.func).__name__)
        handler = handler.keywords["call_next"]
    assert handler == gateway.proxy.forward
    return [*names, "Proxy.forward"]


def build(**fields: Any) -> Gateway:
    models = fields.pop("models", None)
    return build_gateway(GatewayConfig(**fields), FixedSource(view("a")), clock=FakeClock(),
                         models=models)


FIRST = ["MeterTenants", "Admit"]  # usage per tenant is always counted, budgets held first


def test_a_gateway_has_one_step_per_feature_that_is_on_in_the_documented_order() -> None:
    sticky = SessionRoutingConfig(mode="sticky")
    assert steps_of(build()) == [*FIRST, "Proxy.forward"]
    # the cache's keys carry the chosen version: without a model registry it has no step
    assert steps_of(build(response_cache_url="memory://")) == [*FIRST, "Proxy.forward"]
    assert steps_of(build(sessions=sticky)) == [*FIRST, "PlaceSession", "Proxy.forward"]
    assert steps_of(build(sessions=SessionRoutingConfig(mode="external"))) == [
        *FIRST, "Proxy.forward"]
    models = create_model_registry("memory://")
    assert steps_of(build(models=models)) == [*FIRST, "ChooseAdapter", "ChooseVersion",
                                              "Proxy.forward"]
    assert steps_of(build(models=models, response_cache_url="memory://", sessions=sticky)) == [
        *FIRST, "ChooseAdapter", "ChooseVersion", "CacheAnswers", "PlaceSession",
        "Proxy.forward"]


class FailingClose(httpx.AsyncClient):
    """A control client whose close fails (after closing)."""

    async def aclose(self) -> None:
        await super().aclose()
        raise RuntimeError("close failed")


class CountingPins(MemoryPinStore):
    def __init__(self) -> None:
        super().__init__()
        self.num_closes = 0

    async def close(self) -> None:
        self.num_closes += 1


def test_close_closes_every_part_built_even_when_one_fails_and_not_the_callers_pins() -> None:
    upstreams = Upstreams(a=lambda request: json_answer({"id": "cmpl-1", "choices": []}))
    control = FailingClose(transport=upstreams.transport())
    callers_pins = CountingPins()
    config = GatewayConfig(sessions=SessionRoutingConfig(mode="sticky"))
    gateway = build_gateway(config, FixedSource(view("a")), transport=upstreams.transport(),
                            control_client=control, clock=FakeClock(), pin_store=callers_pins)
    body = b'{"model": "m", "prompt": "hi"}'
    request = ProxyRequest("POST", "/v1/completions", body, [], RouteRequest(model="m"), 0.0)

    async def story() -> None:
        assert (await gateway.forward(request)).status_code == 200
        assert set(gateway.proxy.upstreams.pools) == {"a"}
        await gateway.close()  # the control client (closed before the pools) fails

    asyncio.run(story())
    assert control.is_closed
    assert gateway.proxy.upstreams.pools == {}
    assert callers_pins.num_closes == 0  # the caller's store: the caller closes it
