"""A simulated instance (sessions on) and a gateway in front of it, as real processes: what the
fuzzers and the security tests send their requests to."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.procs import Proc, spawn
from serve_process import ServeProcess, start_serve

from strata.sim.profile import LatencyProfile

MODEL = "fuzz-sim"
CLIENT_KEY = "tenant-a-client-key"
OTHER_CLIENT_KEY = "tenant-b-client-key"
ADMIN_KEY = "operator-admin-key"
INTERNAL_KEY = "fleet-internal-key"
_GATEWAY_READY = r"Strata gateway on (http://127\.0\.0\.1:\d+) "


@dataclass
class Targets:
    instance: ServeProcess
    gateway: Proc

    @property
    def urls(self) -> dict[str, str]:
        return {"instance": self.instance.url, "gateway": self.gateway.url}


@contextmanager
def sim_stack(root: Path, *, keyed: bool = False) -> Iterator[Targets]:
    """`strata serve --simulate` (no step latency, sessions in memory) and `strata gateway
    --instances` over it; with `keyed`, both take the client keys CLIENT_KEY and
    OTHER_CLIENT_KEY (two tenants), the admin key ADMIN_KEY and the fleet's internal key
    INTERNAL_KEY."""
    profile = root / "fuzz-profile.json"
    LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=0.0,
                   prefill_ms_per_token=0.0, decode_ms_base=0.0, decode_ms_per_seq=0.0
                   ).save(profile)
    auth: list[str] = []
    if keyed:
        (root / "keys").write_text(f"{CLIENT_KEY}\n{OTHER_CLIENT_KEY}\n")
        (root / "admin-key").write_text(ADMIN_KEY + "\n")
        (root / "internal-key").write_text(INTERNAL_KEY + "\n")
        auth = ["--api-key-file", str(root / "keys"), "--admin-key-file", str(root / "admin-key"),
                "--internal-key-file", str(root / "internal-key")]
    instance = start_serve(["--simulate", str(profile), "--max-model-len", "512",
                            "--session-store", "memory://", *auth],
                           cache_dir=root / "cache", timeout_s=60, log_dir=root / "logs")
    gateway = None
    try:
        argv = [sys.executable, "-m", "strata.cli", "gateway", "--instances", instance.url,
                "--port", "0", *auth]
        gateway = spawn("gateway", argv, root / "logs")
        gateway.url = gateway.wait_for_output(_GATEWAY_READY, 60).group(1)
        yield Targets(instance, gateway)
    finally:
        if gateway is not None:
            gateway.kill()
        instance.stop()
