"""Ports for local processes: one free now, and whether one can still be bound.

A port found free is bound by the process it is given to a moment later, so another process
may take it in between: whoever starts the process checks again (`port_is_free`) before a
restart, or retries on a fresh port when the process says it lost it.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` now, binding as `strata serve` and uvicorn do
    (SO_REUSEADDR: connections of a dead process in TIME_WAIT do not hold the port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


__all__ = ["free_port", "port_is_free"]
