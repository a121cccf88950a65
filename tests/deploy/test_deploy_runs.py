"""The deploy files start as shipped: the Helm chart (rendered with its plain, P/D, autoscaled and
external-Redis values) and deploy/compose.yaml, each container's exact command, arguments and
environment run as a local process (tests/deploy/local_fleet.py: only service names, ports and
container paths are mapped here), simulated instances to keep it cheap. Through the gateway,
with the keys the deploy made (generated where none were given): a chat completion, a streamed
one and a drain, each to completion; a client key is refused the drain; Redis refuses a client
without the password; the P/D fleet hands a long prompt off (a sealed handle, pulled).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from deploy_files import CHART, DEPLOY, load_yaml, render_chart
from harness import pooled_http as http
from local_fleet import (
    Container,
    LocalFleet,
    compose_containers,
    helm_containers,
    image_command,
    image_entrypoint,
    image_env,
    listen_here,
    localize,
    pre_stop,
    process_env,
    redis_argv,
    run_to_completion,
    secret_data,
    wait_until,
)

from strata.cluster.ports import free_port

SIMULATED = "instanceDefaults.simulate=smollm2-cpu"  # every group simulated, whatever its model
HELM_VALUES = {"plain": (), "pd": (CHART / "ci" / "pd-values.yaml",),
               "autoscaled": (CHART / "ci" / "autoscaled-values.yaml",),
               "external-redis": (CHART / "ci" / "external-redis-values.yaml",)}
EXTERNAL_REDIS = "redis.state.svc:6379"


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    running = LocalFleet(tmp_path)
    yield running
    running.stop()


def first_line(text: str) -> str:
    return text.split(",")[0].strip()


class Keys:
    def __init__(self, client: str, admin: str) -> None:
        self.client, self.admin = client, admin

    def auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


def drive(gateway: str, keys: Keys, num_instances: int) -> dict[str, Any]:
    """A chat completion, a streamed one and a drain through the gateway; the drained
    instance's view."""
    client = keys.auth(keys.client)
    body = {"model": model_of(gateway, keys, num_instances), "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "hello from the deploy test"}]}
    answer = http.post(f"{gateway}/v1/chat/completions", json=body, headers=client, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8
    streamed = http.post(f"{gateway}/v1/chat/completions", json=body | {"stream": True},
                          headers=client, timeout=60)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    listed = http.get(f"{gateway}/admin/instances", headers=keys.auth(keys.admin),
                       timeout=10).json()["instances"]
    victim = listed[-1]["instance_id"]
    path = f"{gateway}/admin/instances/{victim}/drain"
    assert http.post(path, headers=client, timeout=10).status_code == 403
    drained = http.post(path, headers=keys.auth(keys.admin), timeout=30)
    assert drained.status_code == 202, drained.text
    assert drained.json()["instance_status"] == 202  # the instance took the internal key
    return {"instance_id": victim, "url": listed[-1]["url"]}


def model_of(gateway: str, keys: Keys, num_instances: int) -> str:
    """The model the fleet serves, once the gateway routes to every instance."""
    wait_until(lambda: _routable(gateway) == num_instances, 60, "every instance routable")
    models = http.get(f"{gateway}/v1/models", headers=keys.auth(keys.client), timeout=10)
    return str(models.json()["data"][0]["id"])


def _routable(gateway: str) -> int:
    try:
        answer = http.get(f"{gateway}/ready", timeout=2)
    except httpx.HTTPError:
        return -1
    return int(answer.json()["num_routable"]) if answer.status_code == 200 else 0


def refuses_without_password(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(200).startswith(b"-NOAUTH")


def remote_prefills(gateway: str) -> float:
    text = http.get(f"{gateway}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('strata:gateway_pd_prefills_total{outcome="ok"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("values", list(HELM_VALUES))
def test_the_chart_starts_as_shipped(fleet: LocalFleet, tmp_path: Path, values: str) -> None:
    manifests = render_chart(*HELM_VALUES[values], SIMULATED)
    secret = next(iter(secret_data(manifests).values()))
    extra_hosts: dict[str, str] = {}
    external: list[Container] = []
    if values == "external-redis":  # the Redis the values name, with the password they give
        port = free_port()
        argv = redis_argv(["redis-server", "--requirepass", secret["STRATA_REDIS_PASSWORD"]],
                          port, tmp_path / "external-redis")
        external.append(Container("external-redis", "redis", argv, process_env({}), port))
        extra_hosts[EXTERNAL_REDIS] = f"127.0.0.1:{port}"
    containers = [*external, *helm_containers(manifests, tmp_path, extra_hosts)]
    fleet.start(containers)
    gateways = [c for c in containers if c.name.startswith("strata-gateway")]
    instances = [c for c in containers if c.name.startswith("strata-instance")]
    for redis in (c for c in containers if c.kind == "redis"):
        assert refuses_without_password(redis.port)
    gateway = f"http://127.0.0.1:{gateways[0].port}"
    keys = Keys(first_line(secret["STRATA_API_KEYS"]), secret["STRATA_ADMIN_KEYS"])
    if values == "pd":
        long = {"model": model_of(gateway, keys, len(instances)), "max_tokens": 4,
                "prompt": "word " * 400}
        before = remote_prefills(gateway)
        answer = http.post(f"{gateway}/v1/completions", json=long, timeout=60,
                            headers=keys.auth(keys.client))
        assert answer.status_code == 200, answer.text
        assert remote_prefills(gateway) == before + 1
    drained = drive(gateway, keys, len(instances))
    [pod] = [c for c in instances if c.name == drained["instance_id"]]
    hook = subprocess.run(pre_stop(manifests, pod), env=pod.env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert hook.returncode == 0, hook.stdout + hook.stderr  # the preStop drain, its own key
    assert http.get(f"http://127.0.0.1:{pod.port}/ready", timeout=5).status_code == 503


def test_the_compose_file_starts_as_shipped(fleet: LocalFleet, tmp_path: Path) -> None:
    compose = load_yaml(DEPLOY / "compose.yaml")
    env = {"STRATA_MODEL": "--simulate=smollm2-cpu"}  # as the file's header says
    containers, keys_argv = compose_containers(compose, tmp_path, env)
    said = run_to_completion(keys_argv, {})
    assert "api.keys: generated" in said and "internal.key: generated" in said
    key_dir = tmp_path / "volumes" / "strata-keys"
    for path in key_dir.iterdir():
        assert path.stat().st_mode & 0o077 == 0, path  # the owner's only
    assert run_to_completion(keys_argv, {}).count(": kept") == 4  # a restart keeps them
    fleet.start(containers)
    for redis in (c for c in containers if c.kind == "redis"):
        assert refuses_without_password(redis.port)
    keys = Keys((key_dir / "api.keys").read_text().splitlines()[0],
                (key_dir / "admin.key").read_text().strip())
    [gateway] = [c for c in containers if c.name == "gateway"]
    instances = [c for c in containers if c.name.startswith("instance-")]
    drive(f"http://127.0.0.1:{gateway.port}", keys, len(instances))
    for container in containers:  # no key was ever on a command line: only file names
        assert keys.client not in " ".join(container.argv)


def test_the_images_default_command_starts_keyed(fleet: LocalFleet, tmp_path: Path) -> None:
    """`docker run strata:cpu` with nothing else: the entry point makes the keys the default
    command names, and the instance serves behind them (simulated here: no model download)."""
    paths = {"/run/strata-keys": str(tmp_path / "keys")}
    env = {k: localize(v, {}, paths) for k, v in image_env().items()}
    port = free_port()
    args = listen_here([localize(a, {}, paths) for a in image_command()], 8000, port)
    fleet.start([Container("default", "strata",
                           [*image_entrypoint(), *args, "--simulate", "smollm2-cpu"],
                           process_env(env), port, "/ready")])
    client = (tmp_path / "keys" / "api.keys").read_text().strip()
    url = f"http://127.0.0.1:{port}/v1/models"
    assert http.get(url, timeout=10).status_code == 401
    assert http.get(url, headers={"Authorization": f"Bearer {client}"},
                     timeout=10).status_code == 200
