"""deploy/helm/strata, rendered by a real helm 3 (the `helm-binary` package) and checked offline.

For the default values and for ci/all-options-values.yaml (every option on): `helm lint`, then
every rendered manifest against the Kubernetes JSON schemas (kubernetes-validate, strict: an
unknown field fails), with YAML that refuses a key given twice. Custom resources the schemas do
not cover (KEDA's ScaledObject, KubeRay's RayCluster) are checked for their apiVersion, kind and
required fields, and the pod templates inside a RayCluster are validated as PodTemplates.
Then what the schemas cannot know: probes, the preStop drain and the grace period around it,
selectors that select, autoscalers that target a Deployment, and command lines that `strata`
itself accepts.
"""

from __future__ import annotations

import base64
import copy
import re
from typing import Any

import kubernetes_validate
import pytest
from deploy_files import (
    ALL_OPTIONS,
    CHART,
    DEPLOY,
    RenderError,
    keda_queries,
    load_yaml,
    metric_names,
    parse_strata,
    render_chart,
    run_helm,
)

K8S_VERSION = "1.30.0"  # the oldest version the chart is meant for that the schemas cover
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("ray.io/v1", "RayCluster")}
VALUES = {"default": (), "all-options": (ALL_OPTIONS,), "pd": (CHART / "ci" / "pd-values.yaml",),
          "autoscaled": (CHART / "ci" / "autoscaled-values.yaml",),
          "external-redis": (CHART / "ci" / "external-redis-values.yaml",)}
KEY_NAMES = ["STRATA_API_KEYS", "STRATA_ADMIN_KEYS", "STRATA_INTERNAL_KEYS",
             "STRATA_REDIS_PASSWORD"]

Manifest = dict[str, Any]


@pytest.fixture(scope="module", params=list(VALUES))
def rendered(request: pytest.FixtureRequest) -> list[Manifest]:
    return render_chart(*VALUES[request.param])


@pytest.fixture(scope="module")
def everything() -> list[Manifest]:
    return render_chart(ALL_OPTIONS)


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def instance_deployments(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in of_kind(manifests, "Deployment")
            if m["metadata"]["labels"]["app.kubernetes.io/component"] == "instance"]


def container(workload: Manifest) -> Manifest:
    [first, *_] = workload["spec"]["template"]["spec"]["containers"]
    return first


def schema_errors(manifest: Manifest) -> list[str]:
    try:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(map(str, e.path))
        return [f"{manifest['kind']} {manifest['metadata']['name']}: {where}: {e.message}"]
    return []


# --- lint and schemas ----------------------------------------------------------------------

@pytest.mark.parametrize("values", list(VALUES))
def test_helm_lint_passes(values: str) -> None:
    flags = [arg for path in VALUES[values] for arg in ("-f", str(path))]
    done = run_helm("lint", "--strict", str(CHART), *flags)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_builtin_manifest_matches_the_kubernetes_schema(rendered: list[Manifest]) -> None:
    builtin = [m for m in rendered if (m["apiVersion"], m["kind"]) not in CUSTOM_KINDS]
    assert builtin
    errors = [error for m in builtin for error in schema_errors(m)]
    assert errors == []


def test_the_schema_check_can_fail(rendered: list[Manifest]) -> None:
    deployment = copy.deepcopy(instance_deployments(rendered)[0])
    container(deployment)["readinesProbe"] = {"httpGet": {"path": "/ready", "port": "http"}}
    container(deployment)["ports"][0]["containerPort"] = "8000"
    errors = schema_errors(deployment)
    assert len(errors) == 1 and ("readinesProbe" in errors[0] or "'8000'" in errors[0])


def test_default_values_render_what_a_small_fleet_needs() -> None:
    kinds = sorted(m["kind"] for m in render_chart())
    assert kinds == ["Deployment", "Deployment", "NetworkPolicy", "NetworkPolicy",
                     "PodDisruptionBudget", "PodDisruptionBudget", "Secret", "Service",
                     "Service", "StatefulSet"]


def test_all_options_render_every_kind(everything: list[Manifest]) -> None:
    assert {m["kind"] for m in everything} == {
        "Deployment", "Service", "PodDisruptionBudget", "StatefulSet", "Secret",
        "HorizontalPodAutoscaler", "ScaledObject", "RayCluster", "NetworkPolicy"}
    assert len(instance_deployments(everything)) == 3


# --- custom resources ------------------------------------------------------------------------

def test_keda_scaled_object_targets_an_instance_deployment_with_a_valid_query(
        everything: list[Manifest]) -> None:
    deployments = {m["metadata"]["name"] for m in instance_deployments(everything)}
    [scaled] = of_kind(everything, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": "strata-instance-v1"}
    assert spec["scaleTargetRef"]["name"] in deployments
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    assert isinstance(trigger["metadata"]["threshold"], str)
    [query] = keda_queries(everything).values()
    assert metric_names(query) == {"strata:num_requests_running", "strata:num_requests_waiting"}
    assert 'namespace="serving"' in query and 'model_version="v1"' in query
    # KEDA owns the replica count of the Deployment it scales
    [target] = [m for m in everything if m["metadata"]["name"] == "strata-instance-v1"
                and m["kind"] == "Deployment"]
    assert "replicas" not in target["spec"]


def test_ray_cluster_has_its_required_fields_and_valid_pod_templates(
        everything: list[Manifest]) -> None:
    [cluster] = of_kind(everything, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = cluster["spec"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"])
    templates = {"head": spec["headGroupSpec"]["template"]}
    assert isinstance(spec["headGroupSpec"]["rayStartParams"], dict)
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        templates[group["groupName"]] = group["template"]
    for name, template in templates.items():
        as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": f"ray-{name}"}, "template": template}
        assert schema_errors(as_pod_template) == [], name
    [service] = [s for s in of_kind(everything, "Service")
                 if s["metadata"]["name"] == "strata-ray-gateway"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                           "ray.io/node-type": "head"}


def test_ray_head_runs_strata_up_with_a_command_strata_accepts(
        everything: list[Manifest]) -> None:
    [cluster] = of_kind(everything, "RayCluster")
    head = container({"spec": cluster["spec"]["headGroupSpec"]})
    assert head["command"] == ["/bin/bash", "-lc", "--"]
    [script] = head["args"]
    assert "${KUBERAY_GEN_RAY_START_CMD//--block/}" in script
    strata_up = script.split("exec strata ", 1)[1].split()
    args = parse_strata([arg.strip('"') for arg in strata_up])
    assert (args.command, args.ray, args.address) == ("up", True, "auto")
    assert (args.host, args.port, args.replicas) == ("0.0.0.0", 8000, 4)
    # not the chart's instances' DB 0; the password from the keys Secret
    assert args.registry == "redis://:$(STRATA_REDIS_PASSWORD)@strata-redis:6379/3"


# --- what the schemas cannot know ------------------------------------------------------------

def test_instances_probe_ready_and_health(rendered: list[Manifest]) -> None:
    for deployment in instance_deployments(rendered):
        c = container(deployment)
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]


def test_gateway_probes_ready_and_health(rendered: list[Manifest]) -> None:
    [gateway] = [m for m in of_kind(rendered, "Deployment")
                 if m["metadata"]["name"] == "strata-gateway"]
    c = container(gateway)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"


def test_prestop_drains_and_the_grace_period_outlasts_drain_and_shutdown(
        rendered: list[Manifest]) -> None:
    for deployment in instance_deployments(rendered):
        c = container(deployment)
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "/opt/strata/drain.py"]
        assert "--url=http://127.0.0.1:8000" in command
        [drain_s] = [float(a.split("=")[1]) for a in command if a.startswith("--timeout-s=")]
        shutdown_s = parse_strata(c["args"]).shutdown_timeout_s
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s > drain_s + shutdown_s, deployment["metadata"]["name"]


def test_a_grace_period_shorter_than_the_drain_is_refused() -> None:
    with pytest.raises(RenderError, match="must be longer than drain.timeoutSeconds"):
        render_chart("instances[0].name=v1", "instances[0].modelVersion=v1",
                     "instances[0].terminationGracePeriodSeconds=60")


@pytest.mark.parametrize(("values", "message"), [
    (("redis.enabled=false",), "set redis.externalUrl"),
    (("instances[0].name=v1", "instances[0].modelVersion=v1",
      "instances[0].keda.enabled=true", "instances[0].hpa.enabled=true"), "keda or hpa"),
    (("instances[0].name=v1",), "set modelVersion"),
    (("instances[0].name=a", "instances[0].modelVersion=v1",
      "instances[1].name=a", "instances[1].modelVersion=v2"), "used twice"),
])
def test_values_that_cannot_work_are_refused(values: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render_chart(*values)


def test_an_external_redis_is_used_for_every_state_url() -> None:
    manifests = render_chart("redis.enabled=false", "redis.externalUrl=redis://cache:6379/")
    assert not of_kind(manifests, "StatefulSet")
    for deployment in of_kind(manifests, "Deployment"):
        args = parse_strata(container(deployment)["args"])
        assert args.registry == "redis://cache:6379/0"
        assert args.session_store == "redis://cache:6379/1"


def test_instance_command_lines_are_ones_strata_accepts(rendered: list[Manifest]) -> None:
    for deployment in instance_deployments(rendered):
        c = container(deployment)
        args = parse_strata(c["args"])
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert args.command == "serve"
        assert (args.host, args.port) == ("0.0.0.0", 8000)
        assert args.model_version == labels["strata.dev/model-version"]
        assert (args.role, args.pool) == (labels["strata.dev/role"], labels["strata.dev/pool"])
        # each pod registers under its own name and at its own address
        assert args.instance_id == "$(POD_NAME)"
        assert args.advertise_url == "http://$(POD_IP):8000"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
               for e in c["env"]}
        assert env["POD_NAME"] == "metadata.name" and env["POD_IP"] == "status.podIP"
        assert args.registry.startswith("redis://")


def test_gateway_command_line_is_one_strata_accepts(rendered: list[Manifest]) -> None:
    [gateway] = [m for m in of_kind(rendered, "Deployment")
                 if m["metadata"]["name"] == "strata-gateway"]
    args = parse_strata(container(gateway)["args"])
    assert (args.command, args.host, args.port) == ("gateway", "0.0.0.0", 8000)
    assert re.fullmatch(r"redis://:\$\(STRATA_REDIS_PASSWORD\)@(strata-redis|redis\.state\.svc)"
                        r":6379/0", args.registry), args.registry


def test_selectors_select_the_pods_they_are_for(rendered: list[Manifest]) -> None:
    workloads = of_kind(rendered, "Deployment") + of_kind(rendered, "StatefulSet")
    pod_labels = {m["metadata"]["name"]: m["spec"]["template"]["metadata"]["labels"]
                  for m in workloads}

    def selected(selector: dict[str, str]) -> set[str]:
        return {name for name, labels in pod_labels.items()
                if selector.items() <= labels.items()}

    for workload in workloads:
        assert selected(workload["spec"]["selector"]["matchLabels"]) == \
            {workload["metadata"]["name"]}
    for pdb in of_kind(rendered, "PodDisruptionBudget"):
        assert selected(pdb["spec"]["selector"]["matchLabels"]) == {pdb["metadata"]["name"]}
    for service in of_kind(rendered, "Service"):
        if "ray.io/cluster" in service["spec"]["selector"]:
            continue  # KubeRay labels the head pod; checked with the RayCluster
        assert selected(service["spec"]["selector"]) == {service["metadata"]["name"]}


def test_hpa_scales_an_instance_deployment_on_a_per_pod_metric(
        everything: list[Manifest]) -> None:
    [hpa] = of_kind(everything, "HorizontalPodAutoscaler")
    names = {m["metadata"]["name"] for m in instance_deployments(everything)}
    assert hpa["spec"]["scaleTargetRef"]["name"] in names
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "strata_num_requests_waiting"


def test_pods_are_annotated_for_prometheus_discovery(rendered: list[Manifest]) -> None:
    for deployment in of_kind(rendered, "Deployment"):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                               "prometheus.io/path": "/metrics"}


def secret_values(manifests: list[Manifest]) -> dict[str, str]:
    [secret] = of_kind(manifests, "Secret")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_every_key_reaches_every_strata_container_from_one_secret(
        everything: list[Manifest]) -> None:
    assert secret_values(everything) == {
        "STRATA_API_KEYS": "key-one,key-two", "STRATA_ADMIN_KEYS": "the-admin-key",
        "STRATA_INTERNAL_KEYS": "the-internal-key", "STRATA_REDIS_PASSWORD": "the-redis-password"}
    [secret] = of_kind(everything, "Secret")
    [cluster] = of_kind(everything, "RayCluster")
    containers = [container(d) for d in of_kind(everything, "Deployment")]
    containers.append(container({"spec": cluster["spec"]["headGroupSpec"]}))
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        for name in KEY_NAMES:
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret["metadata"]["name"], "key": name}, (c["name"], name)


def test_keys_not_given_are_generated_and_kept_across_upgrades() -> None:
    made = secret_values(render_chart())
    assert sorted(made) == sorted(KEY_NAMES)
    assert all(re.fullmatch(r"[A-Za-z0-9]{40}", v) for v in made.values())
    assert len(set(made.values())) == 4
    template = (CHART / "templates" / "keys-secret.yaml").read_text()
    assert '(lookup "v1" "Secret" .Release.Namespace $name)' in template  # an upgrade keeps them
    given = render_chart("keys.existingSecret=mine")
    assert of_kind(given, "Secret") == []
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for d in of_kind(given, "Deployment")
            for e in container(d)["env"] if e["name"] in KEY_NAMES}
    assert refs == {"mine"}


def test_redis_requires_the_password_and_every_url_carries_it(
        rendered: list[Manifest]) -> None:
    for redis in of_kind(rendered, "StatefulSet"):
        c = container(redis)
        assert c["args"][:3] == ["redis-server", "--requirepass", "$(STRATA_REDIS_PASSWORD)"]
        env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]}
        assert env == {"STRATA_REDIS_PASSWORD": "STRATA_REDIS_PASSWORD",
                       "REDISCLI_AUTH": "STRATA_REDIS_PASSWORD"}  # the probe's redis-cli
    for deployment in of_kind(rendered, "Deployment"):
        args = parse_strata(container(deployment)["args"])
        for url in (args.registry, args.session_store):
            assert url.startswith("redis://:$(STRATA_REDIS_PASSWORD)@"), url


def test_network_policies_let_only_the_fleet_reach_instances_and_redis(
        rendered: list[Manifest]) -> None:
    pods = {m["metadata"]["name"]: m["spec"]["template"]["metadata"]["labels"]
            for m in of_kind(rendered, "Deployment") + of_kind(rendered, "StatefulSet")}

    def selected(selector: dict[str, Any]) -> set[str]:
        return {name for name, labels in pods.items()
                if selector["matchLabels"].items() <= labels.items()}

    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(rendered, "NetworkPolicy")}
    instances = {m["metadata"]["name"] for m in instance_deployments(rendered)}
    gateway = {"strata-gateway"}
    spec = policies["strata-instances"]
    assert selected(spec["podSelector"]) == instances and spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    peers = [p for p in rule["from"] if "podSelector" in p and "namespaceSelector" not in p]
    assert set().union(*(selected(p["podSelector"]) for p in peers)) == gateway | instances
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    redis = {m["metadata"]["name"] for m in of_kind(rendered, "StatefulSet")}
    if redis:
        [rule] = policies["strata-redis"]["ingress"]
        assert selected(policies["strata-redis"]["podSelector"]) == redis
        assert set().union(*(selected(p["podSelector"]) for p in rule["from"])) == \
            gateway | instances
    assert not any(selected(p["podSelector"]) & gateway for p in policies.values())


# --- Prometheus finds the chart's pods ---------------------------------------------------------

def relabel(meta: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus's `keep` and `replace` relabelling of one target (None: dropped)."""
    labels = dict(meta)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            if match is None:
                return None
        elif match is not None:
            replacement = re.sub(r"\$(\d+)", r"\\g<\1>", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
    return labels


def discovered(pod: Manifest, pod_ip: str = "10.0.0.7") -> dict[str, str]:
    """The `__meta_kubernetes_pod_*` labels Prometheus's pod discovery gives a pod template
    (one target per container port)."""
    def clean(name: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", name)

    [first_port, *_] = container({"spec": {"template": pod}})["ports"]
    meta = {"__address__": f"{pod_ip}:{first_port['containerPort']}",
            "__meta_kubernetes_namespace": "serving", "__meta_kubernetes_pod_name": "pod-0"}
    for key, value in pod["metadata"]["labels"].items():
        meta[f"__meta_kubernetes_pod_label_{clean(key)}"] = value
    for key, value in pod["metadata"].get("annotations", {}).items():
        meta[f"__meta_kubernetes_pod_annotation_{clean(key)}"] = value
    return meta


def test_prometheus_pod_discovery_finds_the_gateway_and_every_instance_group(
        everything: list[Manifest]) -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus-kubernetes.yml")
    jobs = {j["job_name"]: j["relabel_configs"] for j in config["scrape_configs"]}
    pods = {m["metadata"]["name"]: m["spec"]["template"]
            for m in everything if m["kind"] in ("Deployment", "StatefulSet")}
    [cluster] = of_kind(everything, "RayCluster")
    pods["ray-head"] = cluster["spec"]["headGroupSpec"]["template"]
    found = {name: {job for job, rules in jobs.items() if relabel(discovered(pod), rules)}
             for name, pod in pods.items()}
    assert found == {"strata-gateway": {"strata-gateway"}, "ray-head": {"strata-gateway"},
                     "strata-redis": set(), "strata-instance-v1": {"strata-instances"},
                     "strata-instance-v2-prefill": {"strata-instances"},
                     "strata-instance-sim": {"strata-instances"}}
    target = relabel(discovered(pods["strata-instance-v2-prefill"]), jobs["strata-instances"])
    assert target is not None
    assert {k: target[k] for k in ("__address__", "__metrics_path__", "model_version", "role",
                                   "pool", "namespace")} == {
        "__address__": "10.0.0.7:8000", "__metrics_path__": "/metrics", "model_version": "v2",
        "role": "prefill", "pool": "gpu", "namespace": "serving"}
