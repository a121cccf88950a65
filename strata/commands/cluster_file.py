"""{run_dir}/cluster.json: what a running `strata up` tells the other commands (gateway and
registry URLs, its pid), and the check that keeps two clusters off one run dir."""

from __future__ import annotations

import json
import os
from pathlib import Path

from strata.cluster.local import LocalClusterConfig
from strata.errors import ConfigError


def cluster_file(run_dir: Path) -> Path:
    return run_dir / "cluster.json"


def check_not_running(run_dir: Path) -> None:
    """Two clusters on one run dir would reset each other's registry."""
    try:
        pid = int(json.loads(cluster_file(run_dir).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # a stale file: that cluster died without removing it
    except PermissionError:
        pass
    raise ConfigError(f"a cluster (pid {pid}) is already running with run dir {run_dir}; stop "
                      "it first, or set STRATA_RUN_DIR to another directory")


def write_cluster_file(config: LocalClusterConfig) -> None:
    data = {"gateway_url": f"http://{config.host}:{config.port}",
            "registry_url": config.registry_url, "pid": os.getpid()}
    path = cluster_file(config.run_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # readers never see half a file


__all__ = ["check_not_running", "cluster_file", "write_cluster_file"]
