"""deploy/compose.yaml, the Dockerfile and .dockerignore, checked without a Docker engine.

The compose file is validated against the Compose Specification's JSON schema (the copy that
check-jsonschema ships), then for what the schema cannot know: every Strata service has a
health check on /health or /ready, start order waits on health, the instances advertise
themselves where Prometheus scrapes them, and every file it mounts or builds from exists.
"""

from __future__ import annotations

import json
import re
import tomllib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from deploy_files import DEPLOY, REPO, load_yaml, parse_strata

COMPOSE = DEPLOY / "compose.yaml"
STRATA_PORT = 8000


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = load_yaml(COMPOSE)
    return loaded


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def one_shot() -> dict[str, dict[str, Any]]:
    """Services that run once before the rest (the keys)."""
    return {name: s for name, s in services().items() if s.get("restart") == "no"}


def strata_services() -> dict[str, dict[str, Any]]:
    """The long-running Strata services."""
    return {name: s for name, s in services().items()
            if s.get("image", "").startswith("strata") and name not in one_shot()}


def instances() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in strata_services().items() if s["command"][0] == "serve"}


def parsed(service: dict[str, Any], model: str = "smollm2") -> Any:
    """The service's command as `strata` parses it, STRATA_MODEL set to `model`."""
    return parse_strata([model if arg == "${STRATA_MODEL:-smollm2}" else arg
                         for arg in service["command"]])


def compose_schema_errors(document: dict[str, Any]) -> list[str]:
    text = (resources.files("check_jsonschema") / "builtin_schemas" / "vendor" /
            "compose-spec.json").read_text()
    schema = json.loads(text)
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(document)]


def test_compose_file_matches_the_compose_specification() -> None:
    assert compose_schema_errors(compose()) == []


def test_the_schema_check_can_fail() -> None:
    broken = compose()
    broken["services"]["gateway"]["healthchek"] = broken["services"]["gateway"].pop("healthcheck")
    broken["services"]["redis"]["depends_on"] = {"registry": {"condition": "healthy"}}
    errors = compose_schema_errors(broken)
    assert any("healthchek" in e for e in errors)
    assert any("services/redis/depends_on" in e for e in errors)


def test_the_stack_has_redis_a_registry_a_gateway_instances_prometheus_and_grafana() -> None:
    found = services()
    assert {"keys", "redis", "registry", "gateway", "prometheus", "grafana"} <= set(found)
    assert len(instances()) >= 2
    for name, service in found.items():
        assert "image" in service, f"{name}: no image"
        assert ":" in service["image"] and not service["image"].endswith(":latest"), name


def test_strata_services_are_built_from_the_dockerfile() -> None:
    for name, service in strata_services().items():
        build = service["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == \
            REPO / "Dockerfile", name


def test_every_service_has_a_health_check_strata_ones_on_health_or_ready() -> None:
    for name, service in services().items():
        if name in one_shot():
            continue  # done when it exits 0
        test = service["healthcheck"]["test"]
        if name in ("redis", "registry"):  # redis-cli with the password (REDISCLI_AUTH)
            assert test[0] == "CMD-SHELL" and "REDISCLI_AUTH" in test[1], name
            assert "redis.password" in test[1] and "PONG" in test[1], name
            continue
        assert test[0] == "CMD", name
        if name in strata_services():
            assert test[1:3] == ["python", "/opt/strata/probe.py"], name
            expected = "/ready" if name in instances() else "/health"
            assert test[3] == f"http://127.0.0.1:{STRATA_PORT}{expected}", name


def test_start_order_waits_for_health_and_the_keys() -> None:
    found = services()
    for name, service in found.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in found, f"{name} depends on unknown {dependency}"
            wanted = "service_completed_successfully" if dependency in one_shot() \
                else "service_healthy"
            assert condition == {"condition": wanted}, f"{name} -> {dependency}"
    gateway_needs = set(found["gateway"]["depends_on"])
    assert {"registry", "redis", *instances()} <= gateway_needs
    for name in ("registry", "redis"):
        assert "keys" in found[name]["depends_on"]  # and so everything after them


KEY_DIR = "/run/strata-keys"
PASSWORD = "{{redis.password}}"  # filled in by the image's entry point (deploy/docker/entry.py)


def test_every_strata_service_takes_the_three_keys_from_the_keys_volume() -> None:
    for name, service in strata_services().items():
        args = parsed(service)
        assert (args.api_key_file, args.admin_key_file, args.internal_key_file) == (
            Path(f"{KEY_DIR}/api.keys"), Path(f"{KEY_DIR}/admin.key"),
            Path(f"{KEY_DIR}/internal.key")), name
        assert f"strata-keys:{KEY_DIR}:ro" in service["volumes"], name
        assert not args.insecure, name
    keys = services()["keys"]
    assert keys["entrypoint"] == ["python", "/opt/strata/keys.py"]
    assert keys["command"][0] == KEY_DIR and f"strata-keys:{KEY_DIR}" in keys["volumes"]
    for name in ("STRATA_API_KEYS", "STRATA_ADMIN_KEYS", "STRATA_INTERNAL_KEYS",
                 "STRATA_REDIS_PASSWORD"):
        assert keys["environment"][name] == f"${{{name}:-}}"  # supplied, else generated


def test_both_redis_servers_require_the_password() -> None:
    for name in ("registry", "redis"):
        command = services()[name]["command"]
        assert command[:2] == ["redis-server", f"{KEY_DIR}/redis.conf"], name
        assert f"strata-keys:{KEY_DIR}:ro" in services()[name]["volumes"]


@pytest.mark.parametrize("model", ["smollm2", "--simulate=smollm2-cpu"])
def test_every_strata_command_is_one_strata_accepts(model: str) -> None:
    for name, service in strata_services().items():
        args = parsed(service, model)
        assert args.command == service["command"][0], name
        if name in instances():
            assert (args.model, args.simulate) in {("smollm2", None), (None, "smollm2-cpu")}


def test_a_misspelt_or_abbreviated_flag_is_refused() -> None:
    for typo in ("--advertize-url", "--advertise-ur"):
        with pytest.raises(AssertionError, match="unrecognized arguments"):
            parse_strata(["serve", typo, "http://instance-1:8000"])


def test_instances_register_where_they_are_reached_and_scraped() -> None:
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job["static_configs"] for job in prometheus["scrape_configs"]}
    [instance_targets] = jobs["strata-instances"]
    ids = []
    for name, service in instances().items():
        args = parsed(service)
        assert (args.host, args.port) == ("0.0.0.0", STRATA_PORT)
        assert args.advertise_url == f"http://{name}:{STRATA_PORT}"
        assert args.model_version == instance_targets["labels"]["model_version"]
        assert args.registry == f"redis://:{PASSWORD}@registry:6379/0"
        assert args.session_store == f"redis://:{PASSWORD}@redis:6379/1"
        ids.append(args.instance_id)
    assert len(ids) == len(set(ids))
    assert sorted(instance_targets["targets"]) == sorted(f"{n}:{STRATA_PORT}"
                                                         for n in instances())
    assert jobs["strata-gateway"] == [{"targets": [f"gateway:{STRATA_PORT}"]}]


def test_the_gateway_shares_the_registry_and_is_published_on_loopback() -> None:
    gateway = services()["gateway"]
    args = parsed(gateway)
    assert (args.host, args.port) == ("0.0.0.0", STRATA_PORT)
    assert args.registry == f"redis://:{PASSWORD}@registry:6379/0"
    assert args.session_store == f"redis://:{PASSWORD}@redis:6379/1"
    assert args.response_cache == f"redis://:{PASSWORD}@redis:6379/2"
    assert gateway["ports"] == [f"127.0.0.1:{STRATA_PORT}:{STRATA_PORT}"]
    for name in ("prometheus", "grafana"):
        for port in services()[name]["ports"]:
            assert port.startswith("127.0.0.1:"), name


def test_strata_services_stop_later_than_strata_shuts_down() -> None:
    for name, service in strata_services().items():
        grace_s = int(service["stop_grace_period"].rstrip("s"))
        assert grace_s > parsed(service).shutdown_timeout_s, name


def test_mounted_files_and_named_volumes_exist() -> None:
    declared = set(compose()["volumes"])
    for name, service in services().items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
            else:
                assert source in declared, f"{name}: volume {source} not declared"


# --- Dockerfile ------------------------------------------------------------------------------

DOCKERFILE = (REPO / "Dockerfile").read_text()


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    allowed = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch(prefix, pattern) for prefix in prefixes)
        if hit:
            allowed = negate
    return allowed


def test_dockerignore_keeps_what_the_image_copies_and_drops_the_rest() -> None:
    assert dockerignore_allows("strata/cli.py")
    assert not dockerignore_allows(".venv/bin/python")
    assert not dockerignore_allows("tests/test_cli.py")
    assert not dockerignore_allows("strata/__pycache__/cli.cpython-311.pyc")
    copies = re.findall(r"^COPY (.+) \S+$", DOCKERFILE, flags=re.M)
    sources = [s for line in copies for s in line.split() if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert dockerignore_allows(source.rstrip("/")), f"{source} is excluded by .dockerignore"


def test_the_image_pins_the_torch_of_pyproject_and_picks_cpu_or_cuda() -> None:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch] = [d for d in dependencies if d.startswith("torch")]
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch.split('==')[1])}$", DOCKERFILE,
                     flags=re.M), f"Dockerfile's torch differs from pyproject's {torch}"
    assert re.search(r"^ARG FLAVOR=cpu$", DOCKERFILE, flags=re.M)
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE, flags=re.M))
    assert {"base-cpu", "base-cuda", "runtime"} <= stages
    assert "FROM base-${FLAVOR} AS runtime" in DOCKERFILE
    assert "--index-url https://download.pytorch.org/whl/cpu" in DOCKERFILE


@pytest.mark.parametrize("line", [
    'ENTRYPOINT ["python", "/opt/strata/entry.py"]',
    "ENV STRATA_KEY_DIR=/run/strata-keys",
    'HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \\\n'
    '    CMD ["python", "/opt/strata/probe.py", "http://127.0.0.1:8000/health"]',
    "USER strata",
    "EXPOSE 8000",
])
def test_the_image_runs_strata_as_a_user_with_a_health_check(line: str) -> None:
    assert line in DOCKERFILE
