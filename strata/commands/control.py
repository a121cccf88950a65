"""The control-plane client shared by `strata models`, `strata release` and `strata rollback`.

They talk to a gateway's admin API (strata/gateway/control/admin.py), found by `--gateway URL`,
else the `cluster.json` that `strata up` writes in the run directory, else http://127.0.0.1:8000,
so the same commands drive a local cluster with no flag and a remote one given its gateway URL.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from strata.commands.env import CliEnv
from strata.commands.run_keys import local_admin_key
from strata.errors import StrataError

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
TERMINAL = ("done", "rolled_back", "failed")


def add_control_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default=None, metavar="URL",
                   help="the cluster's gateway (default: the local `strata up` cluster, else "
                        f"{DEFAULT_GATEWAY})")
    p.add_argument("--api-key", default=None,
                   help="admin key (default: the first of STRATA_ADMIN_KEYS, else the one the "
                        "local `strata up` made)")


def gateway_url(args: argparse.Namespace, env: CliEnv) -> str:
    if args.gateway:
        return str(args.gateway).rstrip("/")
    cluster = env.run_dir / "cluster.json"
    try:
        return str(json.loads(cluster.read_text())["gateway_url"]).rstrip("/")
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_GATEWAY


class ControlClient:
    """Admin calls to one gateway; a refusal raises StrataError with the gateway's message."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: CliEnv) -> ControlClient:
        key = args.api_key or (env.admin_keys[0] if env.admin_keys else None)
        if key is None and not args.gateway:  # the local cluster's own: never sent elsewhere
            key = local_admin_key(env.run_dir)
        return cls(gateway_url(args, env), key)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise StrataError(f"cannot reach the gateway at {self.base_url}: {exc}; is the "
                              "cluster up? (pass --gateway URL for a remote one)") from None
        if response.status_code >= 400:
            raise StrataError(f"{method} {path}: {response.status_code} {_message(response)}")
        return response.json() if response.content else None

    def follow(self, release: dict[str, Any], *, timeout_s: float, poll_s: float = 0.5,
               out: Callable[[str], None] = print) -> dict[str, Any]:
        """Print each state the release enters until it ends (or `timeout_s` passes)."""
        start = float(release.get("created_at") or time.time())
        seen = 0
        deadline = time.monotonic() + timeout_s
        while True:
            history = release.get("history") or []
            for state, at in history[seen:]:
                out(f"  {float(at) - start:7.1f}s  {state}")
            seen = len(history)
            if release["state"] in TERMINAL or time.monotonic() > deadline:
                return release
            time.sleep(poll_s)
            release = self.call("GET", f"/admin/releases/{release['release_id']}")

    def close(self) -> None:
        self.http.close()


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def release_outcome(release: dict[str, Any]) -> int:
    """Print how a followed release ended; the exit code (0 only when it is done)."""
    state = release["state"]
    name = f"{release['name']}@{release['to_version']}"
    if state == "done":
        flip = (release.get("stats") or {}).get("ready_to_flip_s")
        detail = f" (ready -> live flip in {flip * 1000:.0f} ms)" if flip is not None else ""
        print(f"release {release['release_id']}: {name} is live{detail}")
        return 0
    reason = f": {release['reason']}" if release.get("reason") else ""
    still = "" if state in TERMINAL else " (still in progress; see `strata release --status`)"
    print(f"release {release['release_id']}: {state}{reason}{still}")
    return 1


__all__ = ["ControlClient", "add_control_flags", "gateway_url", "release_outcome"]
