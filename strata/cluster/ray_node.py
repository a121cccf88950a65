"""Where a Strata process meets Ray: a local Ray of its own on the loopback, or a cluster it
joins by address, as the driver of the node it runs on.

- No address (`strata up --ray`, `strata serve --distributed-executor ray` on their own): a new
  local Ray whose node is 127.0.0.1 (`LOOPBACK`): its GCS, raylet, object store and workers
  listen there alone, and every Strata server on its actors listens there and advertises a
  loopback URL. Ray's own defaults would take the machine's interface address, and
  `ray.init()` with no address joins whichever cluster was started last on the machine
  (/tmp/ray/ray_current_cluster): so "local" is asked for explicitly.
- An address (`--address`, `--ray-address`, `auto`): join that cluster and keep its addresses.
  A process that an actor started on node N joins as a driver of node N (`node_ip`): on one
  machine that runs several nodes (a test's fake nodes on 127.0.0.2, 127.0.0.3, ...) Ray would
  otherwise attach it to the head.

Ray swaps 127.0.0.1 (as a node IP or in an address) for the machine's interface address
(`resolve_ip_for_localhost`) except in its one-machine mode, the default on macOS and Windows
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read once at import into `ray_constants`). A process
that starts or joins a node on 127.0.0.1 turns that mode on for itself (`_stay_on_loopback`);
a node on another loopback address (127.0.0.2, ...: fake nodes) is taken as given, but Ray's
servers on it listen on every interface (only a node on 127.0.0.1 listens on it alone).

A node is a host: ranks of one instance on one node share memory, ranks on two nodes talk over
the network, whatever their addresses (`Node.id` is the identity, never the address). Ray is
imported lazily (it is optional), and nothing here imports torch.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Node:
    """A Ray node: its id (the host identity) and the address it binds."""

    id: str
    address: str

    @staticmethod
    def of(row: dict[str, Any]) -> Node:
        """A row of `ray.nodes()`."""
        return Node(str(row["NodeID"]), str(row["NodeManagerAddress"]))


def connect(address: str | None, *, node_ip: str | None = None,
            num_cpus: float | None = None) -> bool:
    """Connect this process to Ray unless it already is: a new local Ray on the loopback when
    `address` is None, else the cluster at `address` as a driver of the node at `node_ip`
    (None: Ray's pick, the head when it runs here). True when this call connected (the caller
    disconnects with `ray.shutdown()`)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None or is_local_ip(node_ip or "") or is_local_ip(address):
        _stay_on_loopback()
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                               "configure_logging": False}
    if address is None:
        ray.init(address="local", _node_ip_address=node_ip or LOOPBACK,
                 num_cpus=None if num_cpus is None else int(num_cpus), **options)
    else:
        ray.init(address=address, _node_ip_address=node_ip, **options)
    return True


def _stay_on_loopback() -> None:
    """Ray's one-machine mode for this process (see the module docstring): 127.0.0.1 stays."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def this_node() -> Node:
    """The node this process (a driver or a worker) runs on."""
    import ray

    return Node(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP, `host:port` or a URL) is in 127.0.0.0/8 or ::1."""
    host = _host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_ip(address: str) -> bool:
    """Whether `address` (an IP or `host:port`) names what Ray would swap: 127.0.0.1 itself."""
    return _host_of(address) in ("127.0.0.1", "localhost")


def _host_of(address: str) -> str:
    host = address.split("://", 1)[-1].split("/", 1)[0]
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


__all__ = ["LOOPBACK", "Node", "connect", "is_local_ip", "is_loopback", "this_node"]
