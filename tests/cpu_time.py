"""CPU seconds spent so far by this process and every process it started, read from /proc:
ours and our reaped descendants' from `getrusage`, the live descendants' from their stat files
(found through each thread's `children` list). A process that died unreaped, or was adopted by
another parent, is not counted: a lower bound, close where the tests wait for what they start."""

from __future__ import annotations

import os
import resource

_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    return total + sum(_stat_cpu(pid) for pid in _descendants(os.getpid()))


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:  # gone meanwhile, or no /proc: not counted
        pass
    return found


def _descendants(root: int) -> list[int]:
    found, todo = [], _children(root)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += _children(pid)
    return found


def _stat_cpu(pid: int) -> float:
    """utime + stime of a live process, and of its waited-for children (cutime + cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / _TICKS
