"""An adapter release end to end: a real `strata serve` of the tiny model and a real `strata
gateway`, sharing a SQLite registry, with client, admin and internal keys.

Adapter versions are registered under their base (`strata models add tiny:sql@v1 DIR`, and
`POST /admin/models` with `base` as it sends it) and listed under it (`strata models list`);
bad ones are refused with a 4xx. `sql@v1` is released (`strata release sql@v1`, which follows
it to the end), then `sql@v2` under a steady stream of requests for `sql` through
the gateway: none fails, answers say `X-Adapter-Version: sql@v1` until the flip and
`sql@v2` after it (never back), each with its weights' tokens; v1 is unloaded at the end and
the base instance is the same process throughout. A version whose files were replaced after it
was registered is refused by the instance when it loads: that release rolls back and v2 keeps
serving. `strata rollback sql` then releases the previous version, v1, again: its tokens come
back.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.procs import wait_until
from live_stack import GatewayProcess, start_gateway
from lora_fixtures import make_models
from serve_process import ServeProcess, start_serve

from strata.cli import main as strata_cli
from strata.commands.models import split_adapter
from strata.protocol.lora import adapter_digest

CLIENT, ADMIN, INTERNAL = "rel-client-key", "rel-admin-key", "rel-internal-key"
PROMPT = [(7 * i + 3) % 250 for i in range(9)]
TEXTS: dict[str, str] = {}  # adapter version -> its answer to PROMPT (the stories run in order)


@dataclass
class Stack:
    paths: dict[str, Path]
    instance: ServeProcess
    gateway: GatewayProcess

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None
              ) -> httpx.Response:
        return httpx.request(method, f"{self.gateway.url}{path}", json=body, timeout=30,
                             headers={"Authorization": f"Bearer {ADMIN}"})

    def complete(self, model: str, url: str | None = None) -> httpx.Response:
        return httpx.post(f"{url or self.gateway.url}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {CLIENT}"},
                          json={"model": model, "prompt": PROMPT, "max_tokens": 4,
                                "temperature": 0.0, "ignore_eos": True})

    def complete_once_seen(self, model: str, status: int, saying: str = "") -> httpx.Response:
        """`complete(model)` once it answers `status` (with `saying` in its body): the gateway
        reads adapters from the registry, and the instances' residency, every second or so
        (bounded staleness), so a request made at once after a change may still meet the
        view from before it."""
        answers: list[httpx.Response] = []
        try:
            wait_until(lambda: answers.append(self.complete(model)) is None
                       and answers[-1].status_code == status and saying in answers[-1].text,
                       15, f"{model} answering {status} {saying}", interval_s=0.2)
        except TimeoutError:
            pass  # the caller's assert shows the last answer
        return answers[-1]

    def add(self, name: str, version: str, path: Path, **extra: Any) -> httpx.Response:
        return self.admin("POST", "/admin/models", {"name": name, "version": version,
                                                    "uri": str(path), "base": "tiny", **extra})

    def release(self, model: str) -> dict[str, Any]:
        started = self.admin("POST", "/admin/releases", {"model": model})
        assert started.status_code == 202, started.text
        return self.release_followed(started.json()["release_id"])

    def release_followed(self, release_id: str) -> dict[str, Any]:
        final: dict[str, Any] = {}

        def finished() -> bool:
            final.update(self.admin("GET", f"/admin/releases/{release_id}").json())
            return final["state"] in ("done", "rolled_back", "failed")
        wait_until(finished, 60, f"release {release_id} to finish", interval_s=0.1)
        return final

    def cli(self, *argv: str) -> int:
        """`strata ARGV` in this process, against the gateway with the admin key."""
        return strata_cli([*argv, "--gateway", self.gateway.url, "--api-key", ADMIN])

    def instance_models(self) -> set[str]:
        body = httpx.get(f"{self.instance.url}/v1/models", timeout=10,
                         headers={"Authorization": f"Bearer {CLIENT}"}).json()
        return {m["id"] for m in body["data"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("adapter-release")
    paths = make_models(root)
    paths["bad"] = Path(shutil.copytree(paths["a"], root / "lora-bad"))
    for kind, key in (("api", CLIENT), ("admin", ADMIN), ("internal", INTERNAL)):
        (root / kind).write_text(key + "\n")
    keys = ["--api-key-file", str(root / "api"), "--admin-key-file", str(root / "admin"),
            "--internal-key-file", str(root / "internal")]
    registry = f"sqlite:///{root / 'registry.db'}"
    instance = start_serve([str(paths["base"]), "--served-model-name", "tiny", "--model-version",
                            "v1", "--dtype", "float32", "--block-size", "4", "--kv-cache-gb",
                            "0.01", "--max-lora-rank", "8", "--registry", registry,
                            "--instance-id", "i-0", "--log-level", "warning", *keys],
                           cache_dir=root / "cache", timeout_s=120)
    gateway = None
    try:
        gateway = start_gateway(["--registry", registry, "--model-root", str(root),
                                 "--release-propagation-s", "0.5",
                                 "--release-ready-timeout-s", "20",
                                 "--health-check-interval-s", "0.2", *keys])
        stack = Stack(paths, instance, gateway)
        assert stack.admin("POST", "/admin/models", {"name": "tiny", "version": "v1",
                                                     "uri": str(paths["base"])}).status_code == 201
        wait_until(lambda: stack.complete("tiny").status_code == 200, 30, "the gateway to route")
        yield stack
    finally:
        if gateway is not None:
            gateway.stop()
        instance.stop()


def test_adapter_versions_are_registered_under_their_base_and_bad_ones_refused(
        stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    paths = stack.paths
    assert split_adapter("tiny:sql@v1") == ("tiny", "sql", "v1")
    assert split_adapter("tiny@v1") == ("", "tiny", "v1")
    assert stack.cli("models", "add", "tiny:sql@v1", str(paths["a"])) == 0
    digest = adapter_digest(paths["a"])
    assert f"registered tiny:sql@v1 -> {paths['a']} ({digest[:12]})" in capsys.readouterr().out
    assert stack.add("sql", "v2", paths["b"], manifest_sha256="").status_code == 201  # hashed
    assert stack.admin("GET", "/admin/models").json()["models"][0]["adapters"][0]["versions"][
        1]["manifest_sha256"] == adapter_digest(paths["b"])  # by the gateway
    assert stack.add("sql", "v3", paths["bad"]).status_code == 201  # its files change below
    refusals = {
        "unknown base": (stack.admin("POST", "/admin/models", {
            "name": "sql", "version": "v9", "uri": str(paths["a"]), "base": "nope"}), 404),
        "files not the sha256 given": (stack.add("sql", "v9", paths["b"],
                                                 manifest_sha256=adapter_digest(paths["a"])),
                                       400),
        "a model's name": (stack.add("tiny", "v9", paths["a"]), 409),
        "an immutable version": (stack.add("sql", "v1", paths["b"]), 409),
        "not an adapter directory": (stack.add("sql", "v9", paths["base"]), 400),
    }
    for why, (answer, status) in refusals.items():
        assert answer.status_code == status, (why, answer.text)
        assert answer.json()["error"]["message"], why
    listed = stack.admin("GET", "/admin/models").json()["models"]
    assert [m["name"] for m in listed] == ["tiny"]
    assert [v["version"] for v in listed[0]["adapters"][0]["versions"]] == ["v1", "v2", "v3"]
    assert stack.cli("models", "list") == 0
    assert "  sql (adapter)  v1" in capsys.readouterr().out
    unloaded = stack.complete_once_seen("sql@v1", 503)  # registered just now
    assert unloaded.status_code == 503 and "loaded on no ready" in unloaded.text, unloaded.text
    never = stack.complete("sql")  # registered, never released
    assert never.status_code == 404 and "no live version" in never.json()["error"]["message"]
    unknown = stack.complete_once_seen("sql@v7", 404, "v1, v2, v3")  # v3 added just now
    assert unknown.status_code == 404 and "v1, v2, v3" in unknown.json()["error"]["message"]


def test_a_release_flips_requests_to_the_new_weights_without_restarting_or_failing(
        stack: Stack) -> None:
    pid = stack.instance.proc.pid
    assert stack.cli("release", "sql@v1") == 0  # follows it until done
    first = stack.admin("GET", "/admin/releases?model=sql").json()["releases"][-1]
    assert first["state"] == "done" and first["to_version"] == "v1", first
    assert first["base"] == "tiny" and first["replicas"] == 1
    # a first release has nothing to retire: done at the flip, which the gateway reads within
    # its routing poll (--routing-poll-s, 0.2 s); later ones are done after the propagation
    wait_until(lambda: stack.complete("sql").status_code == 200, 5, "the gateway to see v1 live")
    before = stack.complete("sql")
    assert before.status_code == 200 and before.headers["x-adapter-version"] == "sql@v1"
    v1_text = before.json()["choices"][0]["text"]
    seen: list[tuple[int, str, str]] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            r = stack.complete("sql")
            seen.append((r.status_code, r.headers.get("x-adapter-version", ""),
                         r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))
    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    time.sleep(0.3)
    second = stack.release("sql@v2")
    time.sleep(0.3)
    stop.set()
    thread.join(30)
    assert second["state"] == "done", second
    assert [s for s in seen if s[0] != 200] == []
    versions = [version for _, version, _ in seen]
    flip = versions.index("sql@v2")
    assert flip > 0 and set(versions[:flip]) == {"sql@v1"} and set(versions[flip:]) == {"sql@v2"}
    texts = {version: {text for _, v, text in seen if v == version} for version in versions}
    assert texts["sql@v1"] == {v1_text} and len(texts["sql@v2"]) == 1
    assert texts["sql@v2"] != texts["sql@v1"]  # other weights, other tokens
    TEXTS.update({version: found.pop() for version, found in texts.items()})
    models = stack.instance_models()
    assert "sql@v2" in models and "sql@v1" not in models  # the old version was unloaded
    retired = stack.complete_once_seen("sql@v1", 503)  # named, loaded nowhere now: no other
    assert retired.status_code == 503 and "loaded on no ready" in retired.text, retired.text
    assert stack.instance.proc.poll() is None and stack.instance.proc.pid == pid
    listed = stack.admin("GET", "/admin/models").json()["models"][0]["adapters"][0]
    assert listed["routing"]["live"] == "v2" and listed["routing"]["previous"] == "v1"


def test_a_version_whose_files_changed_is_refused_on_load_and_rolls_back(stack: Stack) -> None:
    bad = stack.paths["bad"]
    shutil.copy(stack.paths["b"] / "adapter_model.safetensors", bad / "adapter_model.safetensors")
    shutil.copy(stack.paths["b"] / "adapter_config.json", bad / "adapter_config.json")
    final = stack.release("sql@v3")
    assert final["state"] == "rolled_back", final
    assert "sha256" in final["reason"] and "loading sql@v3" in final["reason"], final
    after = stack.complete("sql")
    assert after.status_code == 200 and after.headers["x-adapter-version"] == "sql@v2"
    assert "sql@v3" not in stack.instance_models()


def test_rolling_an_adapter_back_releases_its_previous_version_again(stack: Stack) -> None:
    started = stack.admin("POST", "/admin/models/sql/rollback")
    assert started.status_code == 202, started.text
    assert started.json()["to_version"] == "v1" and started.json()["from_version"] == "v2"
    final = stack.release_followed(started.json()["release_id"])
    assert final["state"] == "done", final
    after = stack.complete("sql")
    assert after.status_code == 200 and after.headers["x-adapter-version"] == "sql@v1"
    assert after.json()["choices"][0]["text"] == TEXTS["sql@v1"]
    assert {"sql@v1", "sql@v2"} & stack.instance_models() == {"sql@v1"}
