"""The gateway's side alone: which requests the decider sends to a prefill instance, where the
step sits on the path, which instances take whole requests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from gateway_fakes import FakeClock, FixedSource, view
from test_forward import steps_of

from strata.errors import ConfigError
from strata.gateway.config import GatewayConfig, PDRoutingConfig, SessionRoutingConfig
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.routing.pd import Decider, HandOffAsk, prompt_bytes_estimate
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import RouteRequest
from strata.gateway.routing.policies.round_robin import RoundRobinPolicy
from strata.gateway.routing.prefix.feed import PrefixRouting
from strata.gateway.routing.prefix.index import PrefixIndex
from strata.gateway.upstream.proxy import ProxyRequest
from strata.gateway.wiring import build_gateway, has_prefill_instance

LONG = "x" * 400  # 100 tokens by the bytes / 4 estimate


def request(body: dict[str, Any], path: str = "/v1/chat/completions",
            **route: Any) -> HandOffAsk:
    """The decider's ask for a proxied request, as the HandOff step builds it."""
    proxied = ProxyRequest("POST", path, json.dumps(body).encode(), [],
                           RouteRequest(model="m", **route), 0.0, body)
    return HandOffAsk.of(proxied, prompt_bytes_estimate)


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def decider(*views: InstanceView, **config: Any) -> Decider:
    pipeline = RoutingPipeline(InstanceSet(views), RoundRobinPolicy())
    return Decider(PDRoutingConfig(**{"mode": "auto", "min_uncached_tokens": 50, **config}),
                   pipeline)


FLEET = (view("p1", role="prefill"), view("p2", role="prefill"), view("d1", role="decode"))


def test_long_prompts_go_to_a_prefill_instance_short_ones_stay() -> None:
    d = decider(*FLEET)
    remote = d.decide(request(chat(LONG)))
    assert (remote.reason, remote.prefill and remote.prefill.instance_id) == ("remote", "p1")
    assert d.decide(request(chat("x" * 196))).reason == "short"
    completion = {"model": "m", "prompt": LONG}
    assert d.decide(request(completion, "/v1/completions")).reason == "remote"
    token_ids = {"model": "m", "prompt": list(range(60))}  # one prompt of 60 token ids
    assert d.decide(request(token_ids, "/v1/completions")).reason == "remote"


def test_what_cannot_be_handed_over_stays_local() -> None:
    d = decider(*FLEET)
    assert d.decide(request(chat(LONG), session_id="s")).reason == "session"
    assert d.decide(request(chat(LONG, n=2))).reason == "shape"
    batch = {"model": "m", "prompt": [LONG, LONG]}
    assert d.decide(request(batch, "/v1/completions")).reason == "shape"
    assert d.decide(request(chat(LONG), "/tokenize")).reason == "no_prefill"
    assert decider(view("d1", role="decode")).decide(request(chat(LONG))).reason == "no_prefill"
    ejected = decider(view("p1", role="prefill", ejected_until=5.0), view("d1", role="decode"))
    assert ejected.decide(request(chat(LONG))).reason == "no_prefill"


def test_a_busy_prefill_instance_yields_to_the_least_loaded_then_to_local() -> None:
    busy = decider(view("p1", role="prefill", running=2), view("p2", role="prefill", waiting=1),
                   view("d1", role="decode"))
    chosen = busy.decide(request(chat(LONG)))
    assert chosen.prefill is not None and chosen.prefill.instance_id == "p2"
    backlog = decider(view("p1", role="prefill", running=2),
                      view("p2", role="prefill", waiting=3), view("d1", role="decode"))
    assert backlog.decide(request(chat(LONG))).reason == "backlog"
    assert decider(*backlog.pipeline.instances.snapshot(), max_prefill_queue=4).decide(
        request(chat(LONG))).reason == "remote"


def test_the_estimate_counts_prompt_bytes() -> None:
    assert prompt_bytes_estimate(chat("abcd" * 10), []) == 10
    assert prompt_bytes_estimate({"prompt": "abcd" * 3}, []) == 3
    assert prompt_bytes_estimate({"messages": "odd"}, []) == 0
    assert prompt_bytes_estimate({"prompt": [5, 6, 7]}, []) == 3


def test_the_step_is_last_before_the_proxy_and_only_when_on() -> None:
    def build(**fields: Any) -> list[str]:
        return steps_of(build_gateway(GatewayConfig(**fields), FixedSource(view("a")),
                                      clock=FakeClock()))

    assert build() == ["MeterTenants", "Admit", "Proxy.forward"]
    # the hand-off reads what each decode instance holds of the prompt: KeyPrefix keys it
    assert build(pd=PDRoutingConfig(mode="auto")) == ["MeterTenants", "Admit", "KeyPrefix",
                                                      "HandOff", "Proxy.forward"]
    assert build(pd=PDRoutingConfig(mode="auto"), sessions=SessionRoutingConfig(mode="sticky")) == [
        "MeterTenants", "Admit", "PlaceSession", "KeyPrefix", "HandOff", "Proxy.forward"]
    with pytest.raises(ConfigError, match="unknown --pd mode 'on'; valid: auto, off"):
        PDRoutingConfig(mode="on")


def test_decode_and_mixed_instances_take_whole_requests_prefill_ones_do_not() -> None:
    pipeline = RoutingPipeline(InstanceSet([view("a"), view("d", role="decode"),
                                            view("p", role="prefill")]), RoundRobinPolicy())
    assert [v.instance_id for v in pipeline.candidates(RouteRequest(model="m"))] == ["a", "d"]
    assert [v.instance_id for v in pipeline.candidates(RouteRequest(model="m",
                                                                    role="decode"))] == ["d"]


def test_status_sums_up_the_roles_of_each_pool() -> None:
    from strata.commands.status import pools_summary
    from strata.registry.instances.records import InstanceRecord, InstanceState, Role

    def record(iid: str, role: Role, state: InstanceState = InstanceState.READY,
               pool: str = "default") -> InstanceRecord:
        return InstanceRecord(iid, f"http://{iid}", "m", role=role, state=state, pool=pool)

    records = [record("p", Role.PREFILL), record("d1", Role.DECODE),
               record("d2", Role.DECODE, InstanceState.STARTING), record("g", Role.MIXED,
                                                                       pool="gold")]
    assert pools_summary(records).splitlines() == [
        "pool default: 2 decode (1 ready), 1 prefill (1 ready)",
        "pool gold: 1 mixed (1 ready)"]


def test_up_splits_a_prefill_decode_cluster_by_instance_index(tmp_path: Any) -> None:
    import argparse

    from strata.cluster.local import instance_argv
    from strata.commands import up
    from strata.commands.env import CliEnv
    from strata.registry.models import ModelVersion

    parser = argparse.ArgumentParser(prog="strata")
    up.add_parser(parser.add_subparsers(dest="command"))
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run")
    args = parser.parse_args(["up", "--simulate", "smollm2-cpu", "--prefill", "1", "--decode",
                              "2", "--pd-lease-s", "5"])
    config = up._config(args, env)
    assert (config.replicas, config.num_prefill) == (3, 1)
    assert [(p.role, p.replicas) for p in config.pools] == [("prefill", 1), ("decode", 2)]
    assert "--pd-lease-s" in config.serve_args
    version = ModelVersion("m", "v1", "sim:smollm2-cpu")
    argv = instance_argv(config, version, "m-v1-1", 9001, "py", 1, role="decode")
    assert argv[argv.index("--role") + 1] == "decode"
    plain = up._config(parser.parse_args(["up", "--simulate", "smollm2-cpu"]), env)
    assert (plain.replicas, plain.num_prefill) == (2, 0)
    assert "--role" not in instance_argv(plain, version, "m-v1-0", 9001, "py", 0)
    for bad in (["--prefill", "1"], ["--prefill", "1", "--decode", "1", "--replicas", "2"]):
        with pytest.raises(ConfigError, match="--prefill N and --decode M"):
            up._config(parser.parse_args(["up", "--simulate", "smollm2-cpu", *bad]), env)



def test_the_deciders_feed_is_followed_only_while_a_prefill_instance_is_registered() -> None:
    """`--pd auto` is `strata gateway`'s default: without a prefill instance no request is
    handed off, so the decider's index needs no feed (its long polls were 15 % of a one-stream
    gateway's samples, bench/profile_gateway.py); one registers, the feeds are followed; it
    goes, they stop."""
    instances = InstanceSet([view("a"), view("b", role="decode")])

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient() as client:
            prefix = PrefixRouting(PrefixIndex(), instances, client,
                                   is_needed=has_prefill_instance)
            seen = []
            prefix.sync()
            seen.append(prefix.followed)
            instances.add(view("p", role="prefill"))
            prefix.sync()
            seen.append(prefix.followed)
            instances.remove("p")
            prefix.sync()
            seen.append(prefix.followed)
            await prefix.close()
            return seen

    assert asyncio.run(run()) == [[], ["a", "b", "p"], []]
