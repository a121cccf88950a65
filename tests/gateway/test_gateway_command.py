"""`strata gateway`: flags to config, API key files, and SIGTERM letting a stream finish."""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import MODEL_NAME, GatedExecutor, LiveServer, load_tiny, start_server, wait_until
from tiny_models import make_tiny_model_dir

from strata.commands import gateway as gateway_command
from strata.commands.env import CliEnv
from strata.errors import ConfigError
from strata.gateway.config import VersionConfig
from strata.protocol.sse import parse_events
from strata.registry.releases.policy import ReleaseConfig

ENV = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"), api_keys=("k-env",))
SCRIPT = """
import argparse, sys
from pathlib import Path
from strata.commands import gateway
from strata.commands.env import CliEnv
parser = argparse.ArgumentParser()
gateway.add_parser(parser.add_subparsers(dest="command"))
args = parser.parse_args(sys.argv[1:])
sys.exit(gateway.run(args, CliEnv(cache_dir=Path("."), run_dir=Path("."))))
"""


def parse_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["gateway", *flags])


def test_flags_and_env_become_the_config(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nk-one\n\nk-two\nk-env\n")
    args = parse_flags("--instances", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy",
                       "least_load", "--max-in-flight", "8", "--max-queue", "0",
                       "--queue-timeout-s", "2.5", "--max-retries", "1", "--api-key-file",
                       str(key_file), "--rate-limit-per-s", "4")
    config = gateway_command.build_config(args, ENV)
    assert config.instance_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert (config.policy, config.registry_url) == ("least_load", None)
    assert (config.admission.max_in_flight, config.admission.max_queue) == (8, 0)
    assert (config.admission.queue_timeout_s, config.retry.max_retries) == (2.5, 1)
    assert config.api_keys == ("k-one", "k-two", "k-env")
    assert config.rate_limit_per_s == 4.0
    registry_env = CliEnv(Path("/x"), Path("/x"), registry_url="sqlite:///tmp/r.db")
    assert gateway_command.build_config(parse_flags(), registry_env).registry_url == \
        "sqlite:///tmp/r.db"


def test_a_gateway_needs_instances_or_a_registry_but_not_both() -> None:
    with pytest.raises(ConfigError, match="give --registry URL or --instances"):
        gateway_command.build_config(parse_flags(), ENV)
    with pytest.raises(ConfigError, match="either --registry or --instances, not both"):
        gateway_command.build_config(parse_flags("--registry", "memory://", "--instances",
                                                 "http://127.0.0.1:1"), ENV)


@pytest.fixture(scope="module")
def gated_instance(tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[LiveServer, GatedExecutor]]:
    model = load_tiny(make_tiny_model_dir(tmp_path_factory.mktemp("cmd") / "tiny"))
    gates: list[GatedExecutor] = []
    server = start_server(model, wrap=lambda inner: gates.append(GatedExecutor(inner))
                          or gates[-1])
    yield server, gates[0]
    gates[0].open()
    server.stop()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(
        gated_instance: tuple[LiveServer, GatedExecutor]) -> None:
    server, gate = gated_instance
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "gateway", "--port", "0",
                             "--instances", server.base_url, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait_for_url(proc)
        # greedy: the 2 steps the gate allows give this prompt a visible first frame
        gate.hold(allow=2)
        body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 8, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            chunks = response.iter_raw()
            first = next(chunks)
            proc.send_signal(signal.SIGTERM)
            # the gateway has begun its shutdown (it stopped listening); only then may the
            # stream in flight go on
            assert wait_until(lambda: not _listens(url), timeout_s=10)
            gate.open()
            events = list(parse_events([first, *chunks]))
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1])
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_an_idle_client_connection_outlives_the_clients_own_idle_expiry() -> None:
    # uvicorn's default closes an idle connection after 5 s, httpx's pool reuses one up to 5 s:
    # a request sent as the gateway closed it got no answer (a ReadError in the autoscale test)
    assert parse_flags().keep_alive_s == 75.0
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "gateway", "--port", "0",
                             "--instances", "http://127.0.0.1:1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        host, port = _wait_for_url(proc).removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/health")
            first = conn.getresponse()
            first.read()
            time.sleep(6.5)  # past httpx's and uvicorn's default 5 s
            conn.request("GET", "/health")  # on the same connection, or it fails
            assert conn.getresponse().status == first.status
        finally:
            conn.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is not None
        proc.stdout.close()


def _listens(url: str) -> bool:
    """Whether the gateway still takes connections: refused, or reset by a socket that closed
    while the probe's connection waited in its backlog (CI once saw that), is no."""
    try:
        httpx.get(f"{url}/health", timeout=1)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return False
    return True


def _wait_for_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    lines = []
    watchdog = threading.Timer(30.0, proc.kill)  # a stuck start never hangs the suite
    watchdog.start()
    try:
        while line := proc.stdout.readline():
            lines.append(line)
            if m := re.search(r"Strata gateway on (http://127\.0\.0\.1:\d+)", line):
                return m.group(1)
    finally:
        watchdog.cancel()
    raise AssertionError("the gateway did not start:\n" + "".join(lines))


def test_the_gateway_process_moves_its_start_up_objects_out_of_the_collectors_sight() -> None:
    threshold = gc.get_threshold()
    try:
        gateway_command.tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == 20_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_a_release_that_retires_before_every_gateway_polled_is_refused() -> None:
    """The old version retires --release-propagation-s after the flip; a gateway polls the
    registry every --routing-poll-s, so a shorter propagation retires what it still routes to."""
    with pytest.raises(ConfigError, match="--release-propagation-s .* must be at least"):
        VersionConfig(routing_poll_s=2.0, release=ReleaseConfig(propagation_s=1.0))
    assert VersionConfig(routing_poll_s=1.0, release=ReleaseConfig(propagation_s=1.0))
