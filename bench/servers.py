"""Start `strata serve` and vLLM's OpenAI server, wait until ready, load them, stop them by PID
(the process helper is tests/harness/procs.py, shared with the tests).

`fixed_load` drives a server with `strata bench` (the project's load generator): 32 streamed
completions x 128 prompt tokens x 64 output tokens, ignore_eos, all at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.procs import Proc, http_ok, spawn
from workload import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN

ROOT = Path(__file__).resolve().parent.parent
STRATA = ROOT / ".venv" / "bin" / "strata"
LOGS = ROOT / ".bench" / "logs"


@dataclass
class Server:
    name: str
    proc: Proc
    url: str
    ready_s: float  # from the spawn to the first 200 of /v1/models

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its process group (it was started in its own)."""
        self.proc.stop(timeout_s=30)


def _spawn(name: str, cmd: list[str], port: int, env: dict[str, str] | None,
           timeout_s: float) -> Server:
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = spawn(f"{name}-{port}", cmd, LOGS, url=url, env=env, cwd=ROOT)
    try:
        proc.wait_until(lambda: http_ok(f"{url}/v1/models", timeout_s=1.0), timeout_s,
                        f"{url}/v1/models to answer")
    except BaseException:
        proc.stop()
        raise
    return Server(name, proc, url, time.perf_counter() - t0)


def start_strata(model: Path | None, port: int, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> Server:
    """`strata serve` on `model` (None: the default model from the cache)."""
    cmd = [str(STRATA), "serve", *([str(model)] if model else []), "--port", str(port),
           "--threads", "2", "--log-level", "warning", *extra]
    env = (env or dict(os.environ)) | {"STRATA_CACHE_DIR": "/tmp/strata-cache"}
    return _spawn("strata", cmd, port, env, timeout_s=300)


def start_vllm(python: Path, model: Path, port: int, env: dict[str, str],
               extra: tuple[str, ...] = ()) -> Server:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", "2048", *extra]
    return _spawn("vllm", cmd, port, env, timeout_s=600)


def fixed_load(url: str, num: int = NUM_PROMPTS, input_len: int = INPUT_LEN,
               output_len: int = OUTPUT_LEN,
               workload: str = "fixed", extra: tuple[str, ...] = (), seed: int = 0) -> dict:
    """Run `strata bench` against `url`; its JSON report.

    The prompts depend only on `seed`: give each measured round its own, or every round after
    the first reuses the prompts the server's prefix cache already holds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [str(STRATA), "bench", "--url", url, "--workload", workload,
               "--num-requests", str(num), "--input-len", str(input_len),
               "--output-len", str(output_len), "--concurrency", str(num), "--out", str(out),
               "--seed", str(seed), "--no-progress", *extra]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.loads(out.read_text())


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and all its descendants (vLLM runs several processes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(ln.split()[1]) for ln in status.splitlines()
                          if ln.startswith("VmRSS:"))
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
        todo += [int(c) for c in children]
    return total / 1024
