"""The whole fleet at once (issue 24 item 8): one `strata up` with every feature on, real
processes, the tiny model in float32 on the CPU. The fleet (described there), its clients and
its faults are in tests/whole_fleet.py, shared with bench/whole_fleet.py (the same story at ten
times the load).

The story: two tenants ask the same prompt twice each; an interactive request; two sessions of
three turns; eight long streams at once (preemptions); then, under load from both tenants, a
decode instance is SIGKILLed mid-stream, and while it restarts every other instance (the
prefill instance, the other decode instance, the interactive pool's) is SIGKILLed at once; once
all are back, a canary release of v2 (other weights, T=2) is followed to `done`.

Asserted: no request failed (but one that a rank of the T=2 instance cannot run, which fails
alone while that instance serves on); every greedy answer (its tokens, through the logprobs'
bytes) is the answer of one plain `strata serve` instance of its version given the same messages
(a session's whole history); a tenant's prompt gets no cached tokens from the other tenant's
blocks, though its own repeat does; and each feature fired: remote prefills (also T=1 prefill to
T=2 decode, with no handshake refusal), the decider keeping a cached prompt local, a resumed
stream, preemptions, requests that waited for the restarting fleet, sessions sticky and in
Redis, the release through canary to done with its instance registered at tp2, autoscaler
decisions on measured windows for every pool, the interactive pool held to its class's SLOs and
the decode pool's ITL measured at the gateway, and a handle that no decode instance pulled
released within its 2 s grace.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.procs import wait_until
from redis_server import RedisServer, redis_server  # noqa: F401
from resume_streams import events_of, frames_of
from whole_fleet import (
    CHAT,
    FAST_SLO,
    FAULT_RUN,
    INTERNAL_KEY,
    KEY_A,
    KEY_B,
    LONG,
    MODEL,
    TP2,
    Answer,
    Fleet,
    Load,
    ask,
    cached_tokens,
    check_against_references,
    decode_killed_mid_stream,
    instance_metric,
    outage,
    release_v2,
    role_of,
    routable,
    start_fleet,
    user,
)

from strata.protocol.keys import auth_header, tenant_of_key
from strata.protocol.pd import PREFILL_PREFIX

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory,
          redis_server: RedisServer) -> Iterator[Fleet]:  # noqa: F811
    with start_fleet(tmp_path_factory.mktemp("whole-fleet"), redis_server.url) as started:
        yield started


def test_the_whole_fleet(fleet: Fleet, tmp_path: Path) -> None:
    started = time.monotonic()

    def phase(name: str) -> None:
        print(f"whole fleet: {name} at {time.monotonic() - started:.0f}s", flush=True)

    answers = tenants_and_prefix_hits(fleet)
    answers += interactive_class(fleet)
    answers += sessions(fleet)
    phase("sessions done")
    unpulled_handle_freed(fleet)
    answers += preemptions(fleet)
    phase("preemptions done")
    a_request_a_rank_cannot_run_fails_alone(fleet)
    load = Load(fleet.url).start()
    pulled_by_tp2 = instance_metric(fleet.instances()[TP2]["url"], "pd_handoffs_total",
                                    side="decode", outcome="pulled")
    assert pulled_by_tp2 >= 1  # a T=1 prefill fed the T=2 decode instance
    autoscaler_per_class_and_measured(fleet)
    resumed = decode_killed_mid_stream(fleet)
    answers.append(resumed)
    phase("resumed stream done")
    outage(fleet, load)
    phase("prefill and decode back")
    release_v2(fleet, load)
    phase("release done")
    answers += load.finish()
    after = ask(fleet.url, KEY_B, user("after the release " + LONG))
    answers.append(after)
    print(f"whole fleet: {len(answers)} requests in {time.monotonic() - started:.0f}s")
    print("\n".join(line for line in fleet.metrics().splitlines()
                    if line.startswith(SHOWN_METRICS)))
    assert [a.failure for a in answers if a.failure is not None] == []
    assert after.version == f"{MODEL}@v2"
    assert fleet.metric("gateway_pd_prefills_total", outcome="ok") >= 3
    decided = measured_pools(fleet)
    assert decided == {"prefill", "decode", "fast"}, \
        [line for line in fleet.metrics().splitlines() if "autoscaler_pool_decisions" in line]
    check_against_references(answers, fleet, tmp_path)
    phase("references compared")


SHOWN_METRICS = ("strata:gateway_pd_", "strata:gateway_stream_resumes_total",
                 "strata:gateway_recovery_waits_total", "strata:autoscaler_pool_decisions_total")


def tenants_and_prefix_hits(fleet: Fleet) -> list[Answer]:
    """A's prompt twice (the second hits A's blocks), then B's same prompt: none of A's blocks
    serve it, though B's own second ask hits B's."""
    prompt = user("shared words " + LONG)
    a1, a2, b1, b2 = (ask_then_settle(fleet.url, key, prompt)
                      for key in (KEY_A, KEY_A, KEY_B, KEY_B))
    assert [a.failure for a in (a1, a2, b1, b2)] == [None] * 4
    assert cached_tokens(a1) == 0 and cached_tokens(a2) > 0, (a1.usage, a2.usage)
    assert cached_tokens(b1) == 0, b1.usage  # A's blocks are not B's
    assert cached_tokens(b2) > 0, b2.usage
    assert fleet.metric("gateway_pd_prefills_total", outcome="ok") >= 2  # a1 and b1
    # a2 and b2: the decode instance holds the prompt (the decider counts what is cached)
    assert fleet.metric("gateway_pd_decisions_total", reason="short") >= 2
    return [a1, a2, b1, b2]

def unpulled_handle_freed(fleet: Fleet) -> None:
    """A decode instance that dies before it pulls: the prefill instance's handle, asked for as
    the gateway does and then never pulled, gives its blocks back within the 2 s grace for an
    unpulled handle, not the 10 s lease of a pulled one."""
    (prefill,) = role_of(fleet, "prefill")
    url = fleet.instances()[prefill]["url"]
    unpulled = instance_metric(url, "pd_lease_releases_total", reason="unpulled")
    body = {"model": MODEL, "messages": user("no one pulls this " + LONG), "max_tokens": 12}
    r = httpx.post(f"{url}{PREFILL_PREFIX}{CHAT}", json=body, timeout=60,
                   headers=auth_header(INTERNAL_KEY))
    assert r.status_code == 200, r.text
    answered = time.monotonic()
    assert r.json()["num_blocks"] >= 1, r.text

    def released() -> bool:
        return (instance_metric(url, "pd_lease_releases_total", reason="unpulled") > unpulled
                and instance_metric(url, "pd_blocks_held") == 0)

    # 2 s and the 0.1 s expiry sweep; a lease of 10 s (the pulled one's) cannot pass
    wait_until(released, 7.0, "the unpulled handle's blocks released")
    print(f"whole fleet: an unpulled handle released {time.monotonic() - answered:.2f}s after "
          "its answer", flush=True)

def autoscaler_per_class_and_measured(fleet: Fleet) -> None:
    """The interactive class's pool is held to the class's own SLOs, and the decode pool's ITL
    is measured by the gateway (the gaps between the chunks it relays) while streams run."""
    def pool_signal(pool: str, name: str) -> float | None:
        for line in fleet.metrics().splitlines():
            if line.startswith("strata:autoscaler_pool_signal{") and f'name="{name}"' in line \
                    and f'pool="{pool}"' in line:
                return float(line.rpartition(" ")[2])
        return None

    wait_until(lambda: pool_signal("fast", "itl_slo_s") is not None, 30, "the fast pool's SLO")
    assert (pool_signal("fast", "ttft_slo_s"), pool_signal("fast", "itl_slo_s")) == FAST_SLO
    decode_itl_slo = pool_signal("decode", "itl_slo_s")
    assert decode_itl_slo is not None and decode_itl_slo != FAST_SLO[1]  # the deployment's
    wait_until(lambda: (pool_signal("decode", "itl_p95_s") or 0.0) > 0, 60,
               "an ITL measured at the gateway for the decode pool")

def a_request_a_rank_cannot_run_fails_alone(fleet: Fleet) -> None:
    """Failure isolation on a parallel instance: a request whose share rank 0 of the T=2
    instance cannot run ends with finish_reason "error", a request beside it is answered whole,
    and the instance serves on in the same process (no restart)."""
    url, pid = fleet.instances()[TP2]["url"], fleet.tp2.pid
    words = [40, 41, 42, 43, 44, 45, 46, 47]

    def stream(prompt: list[int], out: list[bytes]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "stream": True}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth_header(KEY_A),
                       timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.content)

    def finish_reasons(raw: bytes) -> list[str]:
        return [c["finish_reason"] for e in events_of(frames_of(raw))
                for c in e.get("choices", []) if c.get("finish_reason")]

    poisoned: list[bytes] = []
    healthy: list[bytes] = []
    threads = [threading.Thread(target=stream, args=([*words[:3], *FAULT_RUN, *words[3:]],
                                                    poisoned)),
               threading.Thread(target=stream, args=(words, healthy))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    assert [finish_reasons(r) for r in poisoned + healthy] == [["error"], ["length"]], (
        poisoned, healthy)
    again: list[bytes] = []
    stream(words[::-1], again)
    assert [finish_reasons(r) for r in again] == [["length"]]
    assert fleet.tp2.is_running and fleet.tp2.pid == pid and routable(fleet, TP2)

def ask_then_settle(url: str, key: str, messages: list[dict[str, str]]) -> Answer:
    """`ask`, then a second for the gateway's prefix index to learn the blocks it left (the
    instances' events come by long poll, within 0.1-0.5 s on a quiet machine)."""
    answer = ask(url, key, messages)
    time.sleep(1.0)
    return answer

def interactive_class(fleet: Fleet) -> list[Answer]:
    """An interactive request goes to the interactive pool's instance."""
    fast = [iid for iid, i in fleet.instances().items() if i["pool"] == "fast"]
    answer = ask(fleet.url, KEY_A, user("quick " + LONG), headers={"x-priority": "interactive"})
    assert answer.failure is None and [answer.instance] == fast, (answer.instance, fast)
    return [answer]

def sessions(fleet: Fleet) -> list[Answer]:
    """Three turns of a session per tenant, sticky to one instance; each turn's messages as the
    model saw them are the session's whole history (what the reference is given)."""
    out: list[Answer] = []
    for key in (KEY_A, KEY_B):
        history: list[dict[str, str]] = []
        served_by = set()
        for turn in range(3):
            said = user(f"turn {turn} of {key[-1]}: tell me of the mill")
            answer = ask(fleet.url, key, said, headers={"x-session-id": f"chat-{key[-1]}"})
            assert answer.failure is None, answer.failure
            answer.body = answer.body | {"messages": history + said}
            reply = json.loads(answer.raw)["choices"][0]["message"]["content"]
            history += [*said, {"role": "assistant", "content": reply}]
            served_by.add(answer.instance)
            out.append(answer)
        assert len(served_by) == 1, served_by  # sticky
        assert_in_redis(fleet, key, f"chat-{key[-1]}", num_messages=6)
    return out

def preemptions(fleet: Fleet) -> list[Answer]:
    """Eight 200-token streams at once: they need more blocks than both decode instances hold
    (49 at T=1; the T=2 instance's ranks hold half a block's bytes each, so 98), so one of them
    preempts (and answers every stream whole)."""
    decoders = {iid: i["url"] for iid, i in fleet.instances().items() if i["role"] == "decode"}

    def preempted() -> float:
        return sum(instance_metric(url, "num_preemptions_total") for url in decoders.values())

    before = preempted()
    out: list[Answer] = []
    threads = [threading.Thread(target=lambda n=n: out.append(ask(
        fleet.url, (KEY_A, KEY_B)[n % 2], user(f"story {n}"), stream=True, max_tokens=200)))
        for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert len(out) == 8 and [a.failure for a in out] == [None] * 8
    assert {a.instance for a in out} <= set(decoders)
    assert preempted() > before
    return out

def assert_in_redis(fleet: Fleet, key: str, session: str, num_messages: int) -> None:
    """The session's history (the instances') and its pin (the gateway's) are in the Redis."""
    import redis as redis_client

    db = redis_client.Redis.from_url(fleet.redis_url)
    try:
        tenant = tenant_of_key(key)
        assert db.llen(f"strata:sessions:msgs:{len(tenant)}:{tenant}:{session}") == num_messages
        assert list(db.scan_iter(match=f"*:pin:{session}")), "no pin in Redis"
    finally:
        db.close()


def measured_pools(fleet: Fleet) -> set[str]:
    """The pools the autoscaler has decided for on a measured rate (not in a first window)."""
    return {pool for pool in ("prefill", "decode", "fast")
            for reason in ("within_band", "at_min_replicas", "at_max_replicas")
            if fleet.metric("autoscaler_pool_decisions_total", pool=pool, reason=reason)}
