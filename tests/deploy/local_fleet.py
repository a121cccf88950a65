"""The deploy files' containers run as local processes: each container's exact command, arguments
and environment (secrets from the rendered Secret or the keys the compose `keys` service makes,
Kubernetes' `$(VAR)` expansion, the image's ENTRYPOINT and ENV from the Dockerfile), with only
where things are changed: a service name or pod address becomes 127.0.0.1 and a port of its own,
a container path (a volume, /opt/strata) a directory of the test's.

    fleet = LocalFleet(root)
    fleet.start(helm_containers(manifests, fleet))   # or compose_containers(...)
    fleet.gateway_url ...; fleet.stop()

Redis containers run the local redis-server binary (tests/redis_server.py finds it) with their
arguments; the Strata image's entry point runs as `python deploy/docker/entry.py ARGS`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy_files import DEPLOY, REPO
from harness import pooled_http
from harness.procs import Proc, spawn, wait_until
from redis_server import redis_server_binary

from strata.cluster.ports import free_port

Manifest = dict[str, Any]
DOCKER = DEPLOY / "docker"
IMAGE_DIR = "/opt/strata"  # where the Dockerfile copies deploy/docker/*.py


@dataclass
class Container:
    """One process to start: `argv` and `env` as the deploy file gives them, localized."""

    name: str
    kind: str  # "redis" or "strata"
    argv: list[str]
    env: dict[str, str]
    port: int  # where it listens here
    ready_path: str | None = None  # strata: /ready or /health; redis: None (a TCP connect)
    order: int = 0  # started in ascending order, each ready before the next group


@dataclass
class LocalFleet:
    root: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, containers: Iterable[Container], timeout_s: float = 120) -> None:
        ordered = sorted(containers, key=lambda c: c.order)
        for order in sorted({c.order for c in ordered}):
            group = [c for c in ordered if c.order == order]
            for c in group:
                self.procs[c.name] = spawn(c.name, c.argv, self.root / "logs", env=c.env,
                                           cwd=self.root)
            for c in group:
                proc = self.procs[c.name]
                proc.wait_until(lambda c=c: _is_ready(c), timeout_s, f"{c.name} to be ready")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()


def _is_ready(c: Container) -> bool:
    if c.ready_path is not None:
        return pooled_http.ok(f"http://127.0.0.1:{c.port}{c.ready_path}")
    try:
        with socket.create_connection(("127.0.0.1", c.port), timeout=1):
            return True
    except OSError:
        return False


# --- what every container shares ----------------------------------------------------------

def image_entrypoint() -> list[str]:
    """The Dockerfile's ENTRYPOINT, its script taken from deploy/docker/."""
    found = re.search(r"^ENTRYPOINT (\[.*\])$", (REPO / "Dockerfile").read_text(), flags=re.M)
    assert found, "the Dockerfile has no ENTRYPOINT"
    entry: list[str] = json.loads(found.group(1))
    return [sys.executable if arg == "python" else localize(arg, {}, {}) for arg in entry]


def image_command() -> list[str]:
    """The Dockerfile's CMD: the default command."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    found = re.search(r"^CMD (\[.*\])$", text, flags=re.M)
    assert found, "the Dockerfile has no CMD"
    command: list[str] = json.loads(found.group(1))
    return command


def image_env() -> dict[str, str]:
    """The Dockerfile's ENV (but PATH, the image's own venv)."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, flags=re.M):
        for pair in shlex.split(line):
            name, _, value = pair.partition("=")
            if name != "PATH":
                env[name] = value
    return env


def process_env(container_env: dict[str, str]) -> dict[str, str]:
    """What a local process needs beyond the container's own: the venv's bin on PATH (the
    image's `strata`), HOME."""
    bin_dir = str(Path(sys.executable).parent)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "HOME": os.environ["HOME"],
            **container_env}


def localize(arg: str, hosts: dict[str, str], paths: dict[str, str]) -> str:
    """`arg` with each `HOST:PORT` of `hosts` and each container path of `paths` (a prefix)
    replaced; /opt/strata is deploy/docker here."""
    for address, local in hosts.items():
        arg = re.sub(rf"(?<![\w.-]){re.escape(address)}(?![\w.-])", local, arg)
    for inside, here in {**paths, IMAGE_DIR: str(DOCKER)}.items():
        arg = re.sub(rf"(?<![\w./-]){re.escape(inside)}(?=/|$)", here, arg)
    return arg


def listen_here(args: list[str], container_port: int, port: int) -> list[str]:
    """`--host`, `--port` (both forms) and the advertised URL of the container, here."""
    out: list[str] = []
    for arg in args:
        if out and out[-1] == "--host":
            arg = "127.0.0.1"
        elif out and out[-1] == "--port" and arg == str(container_port):
            arg = str(port)
        arg = arg.replace("--host=0.0.0.0", "--host=127.0.0.1")
        arg = arg.replace(f"--port={container_port}", f"--port={port}")
        arg = arg.replace(f"127.0.0.1:{container_port}", f"127.0.0.1:{port}")
        out.append(arg)
    return out


def redis_argv(args: list[str], port: int, data_dir: Path) -> list[str]:
    """A redis container's `redis-server ARGS`, listening here, writing under `data_dir`."""
    assert args[0] == "redis-server", args
    data_dir.mkdir(parents=True, exist_ok=True)
    return [str(redis_server_binary()), *args[1:], "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(data_dir), "--save", ""]


# --- Helm -----------------------------------------------------------------------------------

def secret_data(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """Each rendered Secret's values, decoded."""
    out: dict[str, dict[str, str]] = {}
    for m in manifests:
        if m["kind"] == "Secret":
            values = {k: base64.b64decode(v).decode() for k, v in m.get("data", {}).items()}
            out[m["metadata"]["name"]] = values | dict(m.get("stringData", {}))
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of a command or argument (unknown names stay)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class Pod:
    name: str
    workload: Manifest
    port: int


def pods_of(manifests: list[Manifest]) -> list[Pod]:
    """One pod per replica of each Deployment and StatefulSet (an autoscaled one: its
    minimum, here 1), each with a port of its own."""
    pods = []
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet"):
            for i in range(m["spec"].get("replicas", 1)):
                pods.append(Pod(f"{m['metadata']['name']}-{i}", m, free_port()))
    return pods


def service_hosts(manifests: list[Manifest], pods: list[Pod]) -> dict[str, str]:
    """`SERVICE:PORT` -> `127.0.0.1:P` of the first pod its selector selects."""
    hosts = {}
    for service in (m for m in manifests if m["kind"] == "Service"):
        selector = service["spec"]["selector"]
        chosen = [p for p in pods
                  if selector.items() <= p.workload["spec"]["template"]["metadata"]["labels"]
                  .items()]
        for port in service["spec"]["ports"]:
            if chosen:
                hosts[f"{service['metadata']['name']}:{port['port']}"] = \
                    f"127.0.0.1:{chosen[0].port}"
    return hosts


def pod_env(pod: Pod, container: Manifest, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            field_path = source["fieldRef"]["fieldPath"]
            env[entry["name"]] = {"metadata.name": pod.name, "status.podIP": "127.0.0.1"}[
                field_path]
    return env


def helm_containers(manifests: list[Manifest], root: Path,
                    extra_hosts: dict[str, str] | None = None) -> list[Container]:
    """The rendered chart's pods as local processes: Redis first, then the instances, then
    the gateway."""
    pods = pods_of(manifests)
    secrets = secret_data(manifests)
    hosts = service_hosts(manifests, pods) | (extra_hosts or {})
    out = []
    for pod in pods:
        [c] = pod.workload["spec"]["template"]["spec"]["containers"]
        container_port = next(p["containerPort"] for p in c["ports"])
        paths = {m["mountPath"]: str(root / pod.name / m["name"])
                 for m in c.get("volumeMounts", [])}
        env = {k: localize(v, hosts, paths) for k, v in pod_env(pod, c, secrets).items()}
        args = [localize(expand(a, env), hosts, paths) for a in c.get("args", [])]
        component = pod.workload["metadata"]["labels"].get("app.kubernetes.io/component")
        if component == "redis":
            argv = redis_argv(args, pod.port, root / pod.name / "data")
            out.append(Container(pod.name, "redis", argv, process_env(env), pod.port))
            continue
        image = {k: localize(v, hosts, paths) for k, v in image_env().items()}
        argv = [*image_entrypoint(), *listen_here(args, container_port, pod.port)]
        is_instance = component == "instance"
        out.append(Container(pod.name, "strata", argv, process_env(image | env), pod.port,
                             "/ready" if is_instance else "/health", 1 if is_instance else 2))
    return out


def pre_stop(manifests: list[Manifest], container: Container) -> list[str]:
    """An instance pod's preStop command, run here against that pod."""
    [workload] = [m for m in manifests if container.name.startswith(m["metadata"]["name"])
                  and m["kind"] == "Deployment"]
    [c] = workload["spec"]["template"]["spec"]["containers"]
    command: list[str] = c["lifecycle"]["preStop"]["exec"]["command"]
    port = next(p["containerPort"] for p in c["ports"])
    args = listen_here([localize(a, {}, {}) for a in command], port, container.port)
    return [sys.executable if a == "python" else a for a in args]


# --- Compose --------------------------------------------------------------------------------

def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` and `$$`."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)
    return text.replace("$$", "$")


def compose_containers(compose: dict[str, Any], root: Path, env: dict[str, str]
                       ) -> tuple[list[Container], list[str]]:
    """(the long-running Redis and Strata services as local processes, in depends_on order;
    the one-shot `keys` service's command, to run to completion first)."""
    services: dict[str, dict[str, Any]] = compose["services"]
    ports = {name: free_port() for name in services}
    hosts = {f"{name}:{port}": f"127.0.0.1:{ports[name]}"
             for name, s in services.items() for port in (6379, 8000)}
    volumes = {name: str(root / "volumes" / name) for name in compose["volumes"]}

    def paths(service: dict[str, Any]) -> dict[str, str]:
        mounted = (m.split(":") for m in service.get("volumes", []))
        return {inside: volumes[source] for source, inside, *_ in mounted if source in volumes}

    keys = services["keys"]
    keys_argv = [localize(interpolate(a, env), {}, paths(keys))
                 for a in [*keys["entrypoint"], *keys["command"]]]
    keys_argv = [sys.executable if a == "python" else a for a in keys_argv]
    out = []
    for name, service in services.items():
        image = service.get("image", "")
        if name == "keys" or not (image.startswith(("strata", "redis"))):
            continue  # prometheus and grafana are not the fleet's
        mapped = paths(service)
        args = [localize(interpolate(a, env), hosts, mapped) for a in service["command"]]
        service_env = {k: localize(interpolate(str(v), env), hosts, mapped)
                       for k, v in service.get("environment", {}).items()}
        if image.startswith("redis"):
            argv = redis_argv(args, ports[name], root / name / "data")
            out.append(Container(name, "redis", argv, process_env(service_env), ports[name]))
            continue
        image_vars = {k: localize(v, hosts, mapped) for k, v in image_env().items()}
        ready = next(a for a in service["healthcheck"]["test"] if a.startswith("http"))
        order = 2 if name == "gateway" else 1
        argv = [*image_entrypoint(), *listen_here(args, 8000, ports[name])]
        out.append(Container(name, "strata", argv, process_env(image_vars | service_env),
                             ports[name], ready.rsplit(":8000", 1)[1], order))
    return out, keys_argv


def run_to_completion(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          env=process_env(env))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


__all__ = ["Container", "LocalFleet", "compose_containers", "expand", "helm_containers",
           "image_command", "image_entrypoint", "image_env", "interpolate", "listen_here",
           "localize", "pre_stop", "process_env", "redis_argv", "run_to_completion",
           "secret_data", "wait_until"]
