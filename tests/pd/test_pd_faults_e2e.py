"""Every kill point of a hand-off, with the killed instance a real `strata serve` process that
SIGKILLs itself where its fault config says (strata/server/pd/faults.py names the points; each
process forked from a zygote that imported torch once: tests/harness/serve_zygote.py), behind a
real gateway: the client gets the mixed instance's answer, never an error, while nothing had reached
it; P's blocks go back to its free pool (at once when another D acknowledged them, else within
the lease + 1 s)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.serve_zygote import ForkedServe, Zygote
from live_server import wait_until
from pd_fleet import (
    INTERNAL_KEY,
    MODEL,
    Instance,
    comparable,
    mixed,
    start_gateway,
    start_instance,
)
from pd_fleet import stream_mixed as mixed_stream
from test_pd_live import LONG, body_of

from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import POLICIES, StatelessPolicy, register_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.model.loader import LoadedModel

CHAT = "/v1/chat/completions"


class FirstCandidate(StatelessPolicy):
    """Always the first candidate by id: the instance named to die is tried first."""

    name = "first_candidate"

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        return candidates[0]


@pytest.fixture(autouse=True, scope="module")
def first_candidate_row() -> Iterator[None]:
    """The toy row for this module's gateways only: a row left in the table would be planned
    by `strata plan`'s tests running later in the same process."""
    register_policy("first_candidate", lambda context: FirstCandidate())
    yield
    del POLICIES["first_candidate"]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """Where each doomed `strata serve` is forked from (torch imported once, not per test)."""
    with Zygote() as running:
        yield running


def serve(zygote: Zygote, tiny_dir: Path, tmp_path: Path, role: str,
          **fault: Any) -> ForkedServe:
    config = tmp_path / f"faults-{role}.json"
    config.write_text(json.dumps(fault))
    key = tmp_path / "internal-key"
    key.write_text(INTERNAL_KEY + "\n")
    return zygote.serve([str(tiny_dir), "--served-model-name", MODEL, "--model-version", "v1",
                        "--dtype", "float32", "--block-size", "8", "--max-model-len", "256",
                        "--threads", "1", "--registry", "none", "--role", role,
                        "--pd-lease-s", "3", "--fault-config", str(config),
                        "--internal-key-file", str(key),
                        "--log-level", "warning"], cache_dir=tmp_path,
                       log=tmp_path / f"serve-{role}.log", timeout_s=600)


@pytest.fixture(scope="module")
def helpers(tiny_model: LoadedModel) -> Iterator[dict[str, Instance]]:
    """An in-process prefill and decode instance that never fail, and the mixed reference."""
    instances = {"p": start_instance(tiny_model, lease_s=3),
                 "d": start_instance(tiny_model), "m": start_instance(tiny_model)}
    yield instances
    for instance in instances.values():
        instance.stop()


def died(process: ForkedServe) -> float:
    """Waits for the process to be SIGKILLed by its fault point; when that was seen."""
    assert process.wait(timeout_s=60) == -9
    return time.monotonic()


def events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [json.loads(f.removeprefix("data: ")) for f in response.text.split("\n\n")
            if f.startswith("data: ") and f != "data: [DONE]"]


@pytest.mark.parametrize("point", ["decode_before_pull", "decode_during_pull",
                                   "decode_after_pull"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_decode_instance_killed_around_the_pull_costs_the_client_nothing(
        zygote: Zygote, tiny_dir: Path, tmp_path: Path, helpers: dict[str, Instance],
        point: str, stream: bool) -> None:
    p, d, m = helpers["p"], helpers["d"], helpers["m"]
    doomed = serve(zygote, tiny_dir, tmp_path, "decode", kill_at=point)
    gateway = start_gateway({"p": (p.url, "prefill"), "d0": (doomed.url, "decode"),
                             "d1": (d.url, "decode")}, policy="first_candidate")
    try:
        body = body_of(LONG, n=len(point) + 100 * stream, temperature=0)
        if stream:
            body = {**body, "stream": True}
            answer = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
            assert [comparable(e) for e in events(answer)] == [
                comparable(e) for e in mixed_stream(m, body)]
        else:
            answer = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert comparable(answer.json()) == comparable(mixed(m, body).json())
        assert answer.headers["x-strata-instance"] == "d1"  # the survivor finished it
        died(doomed)
        assert wait_until(lambda: p.num_held_blocks == 0, timeout_s=3 + 1)
    finally:
        gateway.stop()
        doomed.stop()


def test_a_decode_instance_killed_mid_stream(zygote: Zygote, tiny_dir: Path, tmp_path: Path,
                                             helpers: dict[str, Instance]) -> None:
    p, d, m = helpers["p"], helpers["d"], helpers["m"]
    doomed = serve(zygote, tiny_dir, tmp_path, "decode", kill_at="decode_mid_stream", after=1)
    gateway = start_gateway({"p": (p.url, "prefill"), "d0": (doomed.url, "decode"),
                             "d1": (d.url, "decode")}, policy="first_candidate")
    try:
        body = body_of(LONG, n=31, temperature=0)
        # not streamed: nothing reached the client, so the survivor answers it (1st kill point
        # visit is survived: `after` 1)
        first = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
        assert first.status_code == 200 and first.headers["x-strata-instance"] == "d0"
        second = body_of(LONG, n=34, temperature=0)
        again = httpx.post(f"{gateway.url}{CHAT}", json=second, timeout=60)
        assert again.status_code == 200, again.text
        assert comparable(again.json()) == comparable(mixed(m, second).json())
        assert again.headers["x-strata-instance"] == "d1"
        died(doomed)
        assert wait_until(lambda: p.num_held_blocks == 0)
    finally:
        gateway.stop()
        doomed.stop()


def test_a_decode_stream_cut_mid_stream_is_resumed_on_another_decode_instance(
        zygote: Zygote, tiny_dir: Path, tmp_path: Path, helpers: dict[str, Instance]) -> None:
    """The decode instance of a hand-off is SIGKILLed after its first frame reached the client:
    the gateway resumes the stream on the other decode instance (POST /v1/strata/resume from the
    prompt and the tokens sent), and the client's stream is token for token the mixed one."""
    p, d, m = helpers["p"], helpers["d"], helpers["m"]
    doomed = serve(zygote, tiny_dir, tmp_path, "decode", kill_at="decode_mid_stream")
    gateway = start_gateway({"p": (p.url, "prefill"), "d0": (doomed.url, "decode"),
                             "d1": (d.url, "decode")}, policy="first_candidate")
    try:
        body = {**body_of(LONG, n=36, temperature=0), "stream": True,
                "stream_options": {"include_usage": True}}
        answer = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
        assert answer.headers["x-strata-instance"] == "d0"  # where it began
        assert '"error"' not in answer.text and answer.text.endswith("data: [DONE]\n\n")
        expected = [comparable(e) for e in mixed_stream(m, body)]
        assert [comparable(e) for e in events(answer)] == expected
        died(doomed)
        metrics = httpx.get(f"{gateway.url}/metrics").text
        assert 'strata:gateway_stream_resumes_total{outcome="resumed"} 1.0' in metrics
    finally:
        gateway.stop()
        doomed.stop()


def test_a_stream_cut_after_its_first_frame_ends_with_an_error_event(
        zygote: Zygote, tiny_dir: Path, tmp_path: Path, helpers: dict[str, Instance]) -> None:
    p = helpers["p"]
    doomed = serve(zygote, tiny_dir, tmp_path, "decode", kill_at="decode_mid_stream")
    # the only decode instance never comes back: the resume waits --start-wait-s for it (as
    # for a fleet restarting), then gives up
    gateway = start_gateway({"p": (p.url, "prefill"), "d0": (doomed.url, "decode")},
                            policy="first_candidate", start_wait_s=1.0)
    try:
        body = {**body_of(LONG, n=32, temperature=0), "stream": True}
        answer = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
        assert answer.status_code == 200  # bytes had reached the client (resume: issue 15)
        assert '"error"' in answer.text and answer.text.endswith("data: [DONE]\n\n")
        died(doomed)
        assert wait_until(lambda: p.num_held_blocks == 0)  # acknowledged before the kill
    finally:
        gateway.stop()
        doomed.stop()


def test_blocks_of_a_dead_decode_peer_come_back_within_the_lease(
        zygote: Zygote, tiny_dir: Path, tmp_path: Path, helpers: dict[str, Instance]) -> None:
    p = helpers["p"]
    doomed = serve(zygote, tiny_dir, tmp_path, "decode", kill_at="decode_after_pull")
    gateway = start_gateway({"p": (p.url, "prefill"), "d0": (doomed.url, "decode")},
                            policy="first_candidate", start_wait_s=1.0)
    try:
        body = body_of(LONG, n=33, temperature=0)
        answer = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
        assert answer.status_code == 502  # no decode instance comes back to finish it
        dead_at = died(doomed)
        assert p.num_held_blocks > 0  # pulled, never acknowledged: the lease holds them
        assert wait_until(lambda: p.num_held_blocks == 0, timeout_s=3 + 1)
        assert time.monotonic() - dead_at <= 3 + 1
        assert p.metric("pd_lease_releases_total", reason="expired") >= 1
    finally:
        gateway.stop()
        doomed.stop()


@pytest.mark.parametrize("point", ["prefill_before_answer", "prefill_during_pull"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prefill_instance_killed_costs_the_client_nothing(
        zygote: Zygote, tiny_dir: Path, tmp_path: Path, helpers: dict[str, Instance],
        point: str, stream: bool) -> None:
    d, m = helpers["d"], helpers["m"]
    doomed = serve(zygote, tiny_dir, tmp_path, "prefill", kill_at=point)
    gateway = start_gateway({"p": (doomed.url, "prefill"), "d": (d.url, "decode")})
    try:
        body = {**body_of(LONG, n=len(point) + 7 * stream, temperature=0), "stream": stream}
        answer = httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)
        if stream:
            assert [comparable(e) for e in events(answer)] == [
                comparable(e) for e in mixed_stream(m, body)]
        else:
            assert answer.status_code == 200, answer.text
            assert comparable(answer.json()) == comparable(mixed(m, body).json())
        died(doomed)
    finally:
        gateway.stop()
        doomed.stop()
