"""An instance crash at a write-behind level: what is lost, and how old it was.

A child process (this module's `__main__`) writes turns through a write-behind session store,
printing each acknowledgement (`ACK marker session revision wall_time`) as it happens; the
parent SIGKILLs it mid-run, then reads the store: every acknowledged turn missing from it is
lost, and the loss window is the kill time minus the oldest lost turn's acknowledgement. At
`session` the window should stay near `--session-flush-bound-ms`; at `eventual` it is what the
queue held.

    python -m harness.session_crash REDIS_URL LEVEL BOUND_MS    (the child)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import session_history as jepsen
from strata.state.sessions import create_session_store

NUM_SESSIONS, NUM_WRITERS = 8, 16


@dataclass(frozen=True, slots=True)
class Crash:
    num_acked: int
    num_lost: int
    loss_window_s: float  # kill time - the oldest lost turn's acknowledgement (0: none lost)
    bound_s: float | None


def crash(url: str, level: str, bound_ms: float, *, run_s: float = 2.0) -> Crash:
    """Run the child for `run_s`, SIGKILL it, and measure what its queue lost."""
    tests = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    child = subprocess.Popen([sys.executable, "-m", "harness.session_crash", url, level,
                              str(bound_ms)], stdout=subprocess.PIPE, text=True, env=env)
    acks: dict[str, tuple[str, int, float]] = {}
    assert child.stdout is not None
    started = time.monotonic()
    for line in child.stdout:
        marker, session, revision, at = line.split()[1:]
        acks[marker] = (session, int(revision), float(at))
        if time.monotonic() - started > run_s:
            break
    killed_at = time.time()
    os.kill(child.pid, signal.SIGKILL)
    for line in child.stdout:  # acknowledgements printed before the kill
        marker, session, revision, at = line.split()[1:]
        acks[marker] = (session, int(revision), float(at))
    child.wait()
    final = asyncio.run(_final(url))
    lost = [at for marker, (session, revision, at) in acks.items()
            if final.get(session, [])[revision - 1:revision] != [marker]]
    return Crash(len(acks), len(lost), killed_at - min(lost) if lost else 0.0,
                 bound_ms / 1000 if level == "session" else None)


async def _final(url: str) -> dict[str, list[str]]:
    reader = create_session_store(url)
    try:
        return await jepsen.final_histories(reader, [f"c{i}" for i in range(NUM_SESSIONS)])
    finally:
        await reader.close()


async def _child(url: str, level: str, bound_ms: float) -> None:
    store = create_session_store(url, consistency=level, flush_bound_s=bound_ms / 1000)
    locks = [asyncio.Lock() for _ in range(NUM_SESSIONS)]

    async def writer(w: int) -> None:
        for n in range(1_000_000):
            s = (w + n) % NUM_SESSIONS
            async with locks[s]:
                session = f"c{s}"
                try:
                    record = await store.get(session, tenant=jepsen.TENANT)
                    revision = record.revision if record else 0
                    marker = f"w{w}-{n}"
                    await store.append(session, tenant=jepsen.TENANT,
                                       expected_revision=revision,
                                       messages=[{"role": "user", "content": marker}],
                                       model="m", version="v1", ttl_s=None)
                except Exception:  # refused or the store is slow: try again shortly
                    await asyncio.sleep(0.005)
                    continue
            print(f"ACK {marker} {session} {revision + 1} {time.time()!r}", flush=True)

    await asyncio.gather(*(writer(w) for w in range(NUM_WRITERS)))


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1], sys.argv[2], float(sys.argv[3])))
