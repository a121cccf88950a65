"""Two gateways, simulated instances of m@v1 and m@v2 and one real Redis (the registry), in this
process over real sockets: what a release's consistency is measured on (tests and bench).

    fleet = ReleaseFleet(redis_url, ["--release-consistency", "strict"]).start()
    stream = fleet.stream()                 # steady requests, alternating the gateways
    fleet.cut_b()                           # gateway b's registry connection stops (partition)
    release = fleet.release()               # POST /admin/releases on a, until it flipped
    answers = stream.finish(); fleet.stop()

Gateway `a` reads the registry directly; gateway `b` through a loopback TCP proxy
(harness/tcp_proxy.py) that `cut_b` pauses: its reads and writes hang, as across a partition.
The instances register themselves (READY once they answer), like `strata serve --registry`;
nothing launches or retires processes, so a release is followed until it reports its flip
(the release record enters `retiring`), not to its end. Requests are deterministic
(temperature 0, the same prompt) so each gateway's response cache, when it has one, answers
them from the entries of the version it routes to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import uvicorn
from server.live_server import serve_in_thread
from starlette.applications import Starlette

from harness.tcp_proxy import ChaosProxy
from strata.commands import gateway as gateway_command
from strata.commands.env import CliEnv
from strata.gateway.app import create_gateway_app
from strata.registry.models import ModelRouting, ModelVersion, Release, create_model_registry
from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.server.registration import build_registration
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine

MODEL = "m"
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=1.0,
                         prefill_ms_per_token=0.01, decode_ms_base=1.0, decode_ms_per_seq=0.1)
BODY = {"model": MODEL, "prompt": "the same question", "max_tokens": 2, "temperature": 0}
NO_ENV = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"))


@dataclass
class Served:
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(app: Starlette, sock: socket.socket | None = None) -> Served:
    sock = sock or bound_socket()
    port = sock.getsockname()[1]
    server, thread = serve_in_thread(app, sock, timeout_graceful_shutdown=2)
    return Served(server, thread, f"http://127.0.0.1:{port}")


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def instance(redis_url: str, version: str) -> Served:
    """A simulated instance of m@version that registers itself in the registry."""
    sock = bound_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        PROFILE, max_num_seqs=16, kv_blocks=512, max_model_len=512))
    registration = build_registration(redis_url, instance_id=f"{MODEL}-{version}",
                                      advertise_url=url, model=MODEL, async_engine=engine,
                                      version=version, simulated=True, interval_s=0.5)
    config = ServerConfig(served_model_name=MODEL, model_version=version, simulated=True)
    return serve(create_app(engine, tokenizer, config, registration=registration), sock)


def gateway(registry_url: str, flags: Sequence[str]) -> Served:
    """A gateway as `strata gateway --registry URL FLAGS` builds it, on a real socket."""
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["gateway", "--port", "0", "--registry", registry_url, *flags])
    config = gateway_command.build_config(args, NO_ENV)
    control = httpx.AsyncClient(timeout=2.0)
    source, registry = gateway_command.build_source(config, control)
    models = gateway_command.build_model_registry(config)
    app = create_gateway_app(config, source, control_client=control, models=models,
                             instance_registry=registry)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:  # the registries close, as
        async with inner(app):  # `strata gateway` closes them after serving
            yield
        for store in (registry, models):
            if store is not None:
                await store.close()

    app.router.lifespan_context = lifespan
    return serve(app)


@dataclass
class Answer:
    sent_at: float  # wall clock (the release records' clock)
    gateway: str  # "a" or "b"
    status: int
    version: str  # the answer's X-Model-Version ("" when none)
    retry_after: str = ""


@dataclass
class Stream:
    """Requests one after the other, `interval_s` apart, alternating the gateways."""

    urls: dict[str, str]
    interval_s: float = 0.01
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        names = sorted(self.urls)
        with httpx.Client(timeout=10) as client:
            n = 0
            while not self.stop.is_set():
                name = names[n % len(names)]
                sent_at = time.time()
                try:
                    r = client.post(f"{self.urls[name]}/v1/completions", json=BODY)
                    answer = Answer(sent_at, name, r.status_code,
                                    r.headers.get("x-model-version", ""),
                                    r.headers.get("retry-after", ""))
                except httpx.HTTPError:
                    answer = Answer(sent_at, name, 0, "")
                self.answers.append(answer)
                n += 1
                time.sleep(self.interval_s)

    def finish_after(self, at: float, timeout_s: float = 30.0) -> list[Answer]:
        """Once a request sent after `at` (wall clock) was answered: every answer."""
        deadline = time.monotonic() + timeout_s
        while not any(a.sent_at > at for a in list(self.answers)):
            assert time.monotonic() < deadline, "the stream stopped answering"
            time.sleep(0.01)
        return self.finish()

    def finish(self) -> list[Answer]:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        return list(self.answers)


class ReleaseFleet:
    def __init__(self, redis_url: str, gateway_flags: Sequence[str]) -> None:
        # a database of its own on that server: a process that is not ours polling the port
        # (another user's gateway whose Redis had the port before) reads and writes database 0
        self.redis_url = f"{redis_url.rsplit('/', 1)[0]}/{random.randint(1, 15)}"
        self.gateway_flags = list(gateway_flags)
        self.proxy: ChaosProxy | None = None
        self.instances: list[Served] = []
        self.gateways: dict[str, Served] = {}

    def start(self) -> ReleaseFleet:
        with redis.Redis.from_url(self.redis_url) as client:
            client.flushdb()
        asyncio.run(self._seed())
        self.instances = [instance(self.redis_url, v) for v in ("v1", "v2")]
        port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self.proxy = ChaosProxy(port).start()
        via_proxy = f"redis://127.0.0.1:{self.proxy.port}/{self.redis_url.rsplit('/', 1)[1]}"
        self.gateways = {"a": gateway(self.redis_url, self.gateway_flags),
                         "b": gateway(via_proxy, self.gateway_flags)}
        for url in self.urls.values():
            self._until_served(url)
        return self

    @property
    def urls(self) -> dict[str, str]:
        return {name: served.url for name, served in self.gateways.items()}

    async def _seed(self) -> None:
        models = create_model_registry(self.redis_url)
        try:
            for version in ("v1", "v2"):
                await models.add_version(ModelVersion(MODEL, version, f"sim:{version}"))
            await models.set_routing(ModelRouting(MODEL, live="v1"), expected_revision=0)
        finally:
            await models.close()

    def _until_served(self, url: str, timeout_s: float = 30.0) -> None:
        """Until the gateway answers from v1 (it read the routing and saw both instances)."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
            if r.status_code == 200 and r.headers.get("x-model-version") == f"{MODEL}@v1":
                return
            assert time.monotonic() < deadline, f"{url} never served v1: {r.status_code}"
            time.sleep(0.05)

    def stream(self, interval_s: float = 0.01) -> Stream:
        return Stream(self.urls, interval_s).start()

    def cut_b(self) -> None:
        """Gateway b's registry connection stops forwarding (reads and writes hang)."""
        assert self.proxy is not None
        self.proxy.pause()

    def release(self, timeout_s: float = 60.0) -> Release:
        """Release m@v2 through gateway a; the record once it reported its flip."""
        r = httpx.post(f"{self.urls['a']}/admin/releases", json={"model": f"{MODEL}@v2"},
                       timeout=10)
        assert r.status_code == 202, r.text
        release_id = r.json()["release_id"]
        deadline = time.monotonic() + timeout_s
        while True:
            found: Any = httpx.get(f"{self.urls['a']}/admin/releases/{release_id}",
                                   timeout=10).json()
            if found["state"] in ("retiring", "done", "failed", "rolled_back"):
                return Release.from_json(found)
            assert time.monotonic() < deadline, f"release stuck in {found['state']}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.unpause()
        for served in [*self.gateways.values(), *self.instances]:
            served.stop()
        if self.proxy is not None:
            self.proxy.stop()


def entered(release: Release, state: str) -> float:
    return next(at for s, at in release.history if s == state)


def stale_window_s(answers: list[Answer], gateway: str, since: float) -> float:
    """From `since` to the sending of the last request to `gateway` sent after it and answered
    by v1 (the old version); 0 when none was (negative windows are not counted)."""
    late = [a.sent_at for a in answers if a.gateway == gateway and a.sent_at > since
            and a.version == f"{MODEL}@v1"]
    return max(late) - since if late else 0.0


__all__ = ["MODEL", "Answer", "ReleaseFleet", "Stream", "entered", "stale_window_s"]
