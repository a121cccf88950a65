"""The dashboard in a real headless Chromium, over a real `strata up --replicas 2 --simulate`
cluster with an API key (and the admin key `strata up` made for it), under light load.

Stories: the page asks for a key, then loads from the gateway alone with no console error and
shows the fleet read-only to the client key; an
instance SIGKILLed shows as unhealthy within seconds (and ready again once restarted); a release
run with `strata release` is followed live and its flip shows within seconds, then the rollback
button (with the admin key) brings the previous version back; the drain button is refused to
the client key, even forced, and works with the admin key; the autoscaler's section appears
only with its data; the tenants section shows the client key its own usage; a slow request
links to its trace.

Screenshots go to $STRATA_SCREENSHOT_DIR when set (docs/img/ for the README), else to tmp.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_process import Cluster, start_cluster, wait_until
from harness import pooled_http
from headless_chromium import WatchedPage, chromium, require_chromium, watched_page
from playwright.sync_api import BrowserContext, Page, expect

from strata.commands.run_keys import local_admin_key
from strata.protocol.keys import tenant_of_key
from strata.sim.profile import LatencyProfile

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "m"
FAST = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                      prefill_ms_per_token=0.05, decode_ms_base=5.0, decode_ms_per_seq=0.1)
NOT_SERVING = ("unhealthy", "ejected", "dead", "gone")


class Load:
    """Completions through the gateway from one thread until stopped (bounded in time)."""

    def __init__(self, url: str, max_s: float = 600.0) -> None:
        self.url, self.max_s = url, max_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(timeout=30, headers=AUTH) as client:
            n = 0
            while not self.stop.is_set() and time.monotonic() < deadline:
                body = {"model": MODEL, "prompt": f"hello {n % 7}", "max_tokens": 24,
                        "ignore_eos": True, "stream": n % 2 == 0}
                try:
                    client.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError:
                    pass  # an instance killed or drained on purpose
                n += 1
                self.stop.wait(0.02)  # a light, steady load, not a benchmark

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_chromium()  # skip before starting anything
    root = tmp_path_factory.mktemp("dashboard")
    FAST.save(root / "fast.json")
    started = start_cluster(
        ["--simulate", str(root / "fast.json"), "--served-model-name", MODEL,
         "--model-version", "v1", "--gateway-arg=--release-lease-s=2"], root,
        env_extra={"STRATA_API_KEYS": KEY}, replicas=2)
    with Load(started.url):
        yield started
    assert started.stop() == 0


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


@pytest.fixture
def shots(tmp_path: Path) -> Callable[[Page, str], Path]:
    folder = Path(os.environ.get("STRATA_SCREENSHOT_DIR") or tmp_path)

    def take(page: Page, name: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        page.screenshot(path=str(path), full_page=True)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return path

    return take


def open_dashboard(context: BrowserContext, cluster: Cluster) -> WatchedPage:
    """The page, unlocked with the client key (read-only)."""
    watched = watched_page(context)
    response = watched.page.goto(f"{cluster.url}/dashboard")
    assert response is not None and response.status == 200
    expect(watched.page.locator("#summary")).to_contain_text("enter a key")
    unlock(watched.page, KEY)
    return watched


def admin_key(cluster: Cluster) -> str:
    """The admin key `strata up` made for this cluster (it was given a client key only)."""
    key = local_admin_key(cluster.run_dir)
    assert key is not None
    return key


def row(page: Page, instance_id: str) -> Any:
    return page.locator(f'#instances tr[data-instance="{instance_id}"]')


def gateway_view(cluster: Cluster) -> dict[str, dict[str, Any]]:
    listed = pooled_http.get(f"{cluster.url}/admin/instances", timeout=5,
                       headers={"Authorization": f"Bearer {admin_key(cluster)}"}).json()
    return {i["instance_id"]: i for i in listed["instances"]}


def data(cluster: Cluster) -> dict[str, Any]:
    return pooled_http.get(f"{cluster.url}/dashboard/data", headers=AUTH, timeout=5).json()


def strata(cluster: Cluster, *args: str) -> subprocess.Popen[str]:
    """The CLI as a user on the cluster's machine runs it (the admin key from the run dir)."""
    env = {**os.environ, "STRATA_RUN_DIR": str(cluster.run_dir), "STRATA_API_KEYS": KEY}
    return subprocess.Popen([sys.executable, "-m", "strata.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def unlock(page: Page, key: str) -> None:
    page.fill("#admin-key", key)
    page.click("#key-submit")


def is_live(page: Page, version: str, timeout_s: float) -> None:
    expect(page.locator(f'.model[data-model="{MODEL}"] tr[data-version="{version}"]')
           ).to_have_attribute("data-part", "live", timeout=timeout_s * 1000)


def test_the_page_shows_the_fleet_and_loads_nothing_from_elsewhere(
        cluster: Cluster, browser: BrowserContext, shots: Callable[[Page, str], Path]) -> None:
    line = f"Dashboard: {cluster.url}/dashboard"  # printed right below the cluster's address
    wait_until(lambda: line in cluster.output().splitlines(), 10, "the dashboard's URL line")
    watched = open_dashboard(browser, cluster)
    page = watched.page
    expect(page.locator("#instances tbody tr")).to_have_count(2)
    for instance_id in ("m-v1-0", "m-v1-1"):
        expect(row(page, instance_id)).to_have_attribute("data-status", "ready")
        cells = row(page, instance_id).locator("td").all_inner_texts()
        assert cells[1:5] == ["m@v1 (simulated)", "mixed", "default", "ready"], cells
        assert re.fullmatch(r"\d+\.\d s ago", cells[9]), cells
    is_live(page, "v1", 5)
    expect(page.locator("#access")).to_have_text("read-only")
    expect(page.locator("button.drain").first).to_be_disabled()
    for chart in ("requests", "ttft", "itl", "tokens"):
        expect(page.locator(f"#chart-{chart} canvas")).to_have_count(1)
    # the decode charts fill while the page polls (the instances' counters are read then)
    wait_until(lambda: sum(v is not None for v in data(cluster)["series"]["output_tokens_per_s"])
               >= 8, 60, "eight seconds of output tokens/s", interval_s=0.25)
    assert sum(data(cluster)["series"]["answers_per_s"]) > 0
    page.wait_for_function("() => Number(document.body.dataset.updated) > 0")
    shots(page, "dashboard.png")
    # the one error allowed: the browser's note of the data's 401 before the key was entered
    unexpected = [e for e in watched.console_errors if "status of 401" not in e]
    assert unexpected == [] and watched.page_errors == []
    assert watched.refused == []
    assert {re.sub(r"^http://([^/]+)/.*", r"\1", url) for url in watched.requests} == {
        cluster.url.removeprefix("http://")}
    page.close()


def test_the_autoscaler_section_appears_only_with_its_data(
        cluster: Cluster, browser: BrowserContext) -> None:
    page = open_dashboard(browser, cluster).page
    expect(page.locator("#instances tbody tr")).to_have_count(2)
    expect(page.locator("#autoscaler-section")).to_be_hidden()
    decided = {"decided_at": time.time(), "owner": "autoscaler-1", "targets": [
        {"model": MODEL, "version": "v1", "role": "decode", "pool": "default", "desired": 4,
         "actual": 3, "reason": "queue above target"}]}

    def with_autoscaler(route: Any) -> None:
        answer = route.fetch()
        route.fulfill(response=answer, json=answer.json() | {"autoscaler": decided})

    page.route("**/dashboard/data", with_autoscaler)
    expect(page.locator("#autoscaler-section")).to_be_visible()
    expect(page.locator('#autoscaler tr[data-target="m@v1"] td')).to_have_text(
        ["m@v1", "decode", "default", "4", "3", "queue above target"])
    page.close()


def test_a_slow_request_links_to_its_trace_when_the_gateway_has_a_trace_url(
        cluster: Cluster, browser: BrowserContext) -> None:
    page = open_dashboard(browser, cluster).page
    expect(page.locator("#instances tbody tr")).to_have_count(2)
    expect(page.locator("#slow-section")).to_be_hidden()  # a client key: not its to see
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    slow = [{"at": time.time(), "ttft_ms": 1234.5, "instance_id": "m-v1-0",
             "request_id": "req-1", "trace_id": trace_id},
            {"at": time.time(), "ttft_ms": 800.0, "instance_id": "m-v1-1",
             "request_id": "req-2", "trace_id": None}]

    def with_slow(route: Any) -> None:
        answer = route.fetch()
        route.fulfill(response=answer, json=answer.json() | {
            "slow_requests": slow, "trace_url": "http://traces.example/trace/{trace_id}"})

    page.route("**/dashboard/data", with_slow)
    expect(page.locator("#slow-section")).to_be_visible()
    link = page.locator('#slow tr[data-request="req-1"] a')
    expect(link).to_have_attribute("href", f"http://traces.example/trace/{trace_id}")
    expect(page.locator('#slow tr[data-request="req-2"] td').nth(4)).to_have_text("not traced")
    page.close()


def test_the_tenants_section_shows_the_client_key_its_own_usage(
        cluster: Cluster, browser: BrowserContext) -> None:
    page = open_dashboard(browser, cluster).page
    expect(page.locator("#tenants-section")).to_be_visible()
    mine = page.locator(f'#tenants tr[data-tenant="{tenant_of_key(KEY)}"] td')
    expect(mine).to_have_count(7)
    expect(page.locator("#tenants tbody tr")).to_have_count(1)  # the load's key: its own row
    cells = mine.all_inner_texts()
    assert int(cells[1]) > 0 and int(cells[6]) > 0, cells  # requests, completion tokens
    page.close()


def test_an_instance_killed_shows_as_unhealthy_on_the_next_refresh(
        cluster: Cluster, browser: BrowserContext) -> None:
    watched = open_dashboard(browser, cluster)
    page = watched.page
    victim = "m-v1-1"
    expect(row(page, victim)).to_have_attribute("data-status", "ready", timeout=30_000)
    polls_before = watched.requests.count(f"{cluster.url}/dashboard/data")
    os.kill(cluster.pids()[victim], signal.SIGKILL)
    # the page shows what its own polls of the gateway said after the kill (the wait is a
    # correctness bound, not a speed limit: the page polls every POLL_MS)
    page.wait_for_function(
        "([id, bad]) => bad.includes(document.querySelector("
        "`#instances tr[data-instance='${id}']`)?.dataset.status)",
        arg=[victim, list(NOT_SERVING)], timeout=30_000)
    assert watched.requests.count(f"{cluster.url}/dashboard/data") > polls_before
    # the supervisor restarts it under the same id; the page follows it back
    expect(row(page, victim)).to_have_attribute("data-status", "ready", timeout=60_000)
    page.close()


def test_a_release_is_followed_live_then_the_rollback_button_undoes_it(
        cluster: Cluster, browser: BrowserContext, shots: Callable[[Page, str], Path]) -> None:
    profile = cluster.run_dir.parent / "fast.json"
    add = strata(cluster, "models", "add", f"{MODEL}@v2", f"sim:{profile}")
    assert add.wait(timeout=60) == 0, add.stdout.read() if add.stdout else ""
    page = open_dashboard(browser, cluster).page
    expect(page.locator(f'.model[data-model="{MODEL}"] tr[data-version="v2"]')).to_have_count(1)
    release = strata(cluster, "release", f"{MODEL}@v2")
    try:
        block = page.locator(f'.release[data-model="{MODEL}"]')
        expect(block.locator(".step-current")).to_have_count(1, timeout=60_000)  # in progress
        shots(page, "dashboard-release.png")
        is_live(page, "v2", 120)
        seen_at = time.time()  # wall clock, as the release's history
    finally:
        output, _ = release.communicate(timeout=180)
    assert release.returncode == 0, output
    newest = httpx.get(f"{cluster.url}/admin/releases?model={MODEL}", timeout=5,
                       headers={"Authorization": f"Bearer {admin_key(cluster)}"}
                       ).json()["releases"][-1]
    flipping_at = next(at for state, at in newest["history"] if state == "flipping")
    assert flipping_at <= seen_at, "the page showed v2 live only once the release flipped"
    expect(block).to_have_attribute("data-state", "done", timeout=10_000)
    assert block.locator("li").evaluate_all("items => items.map(i => i.dataset.state)") == [
        "pending", "starting", "warming", "flipping", "retiring", "done"]
    expect(page.locator(f'.model[data-model="{MODEL}"] tr[data-version="v1"]')
           ).to_have_attribute("data-part", "previous")

    rollback = page.locator(f'.model[data-model="{MODEL}"] button.rollback')
    expect(rollback).to_be_disabled()  # read-only with the client key
    unlock(page, admin_key(cluster))
    expect(page.locator("#access")).to_have_text("admin")
    expect(rollback).to_be_enabled()
    rollback.click()
    expect(page.locator("#message")).to_have_text(f"rollback {MODEL}: accepted (202)")
    is_live(page, "v1", 120)
    wait_until(lambda: data(cluster)["releases"][0]["is_terminal"], 120, "the rollback to end")
    page.close()


def test_the_drain_button_is_refused_to_a_client_key_and_works_with_the_admin_key(
        cluster: Cluster, browser: BrowserContext) -> None:
    page = open_dashboard(browser, cluster).page
    wait_until(lambda: sum(i["status"] == "ready" for i in data(cluster)["instances"]) >= 2, 60,
               "two ready instances")
    victim = page.locator('#instances tr[data-status="ready"]').first.get_attribute(
        "data-instance")
    assert victim is not None
    button = row(page, victim).locator("button.drain")
    expect(button).to_be_disabled()
    # a page tampered with: the API refuses (enabled and clicked at once, before a refresh
    # of the page can disable the button again)
    button.evaluate("b => { b.disabled = false; b.click(); }")
    expect(page.locator("#message")).to_contain_text(f"drain {victim}: refused (403)")
    unlock(page, "not-the-key")
    expect(page.locator("#message")).to_have_text("that key is not accepted")
    unlock(page, KEY)
    expect(page.locator("#message")).to_have_text(
        "that key shows the fleet but is not the admin key: read-only")
    expect(button).to_be_disabled()
    assert gateway_view(cluster)[victim]["draining"] is False

    unlock(page, admin_key(cluster))
    expect(page.locator("#access")).to_have_text("admin")
    expect(button).to_be_enabled()
    button.click()
    expect(page.locator("#message")).to_have_text(f"drain {victim}: accepted (202)")
    page.wait_for_function(
        "id => ['draining', 'gone'].includes(document.querySelector("
        "`#instances tr[data-instance='${id}']`)?.dataset.status)", arg=victim, timeout=30_000)
    drained = gateway_view(cluster).get(victim)
    assert drained is None or drained["draining"] is True
    page.close()
