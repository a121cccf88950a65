"""Start `strata serve` and vLLM's OpenAI server, wait until ready, load them, stop them by PID.

`fixed_load` drives a server with `strata bench` (the project's load generator): 32 streamed
completions x 128 prompt tokens x 64 output tokens, ignore_eos, all at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from workload import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN

ROOT = Path(__file__).resolve().parent.parent
STRATA = ROOT / ".venv" / "bin" / "strata"
LOGS = ROOT / ".bench" / "logs"


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    ready_s: float  # from the spawn to the first 200 of /v1/models

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        """SIGTERM the server's process group (it was started in its own), then SIGKILL."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _spawn(name: str, cmd: list[str], port: int, env: dict[str, str] | None,
           timeout_s: float) -> Server:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = (LOGS / f"{name}-{port}.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    server = Server(name, proc, url, 0.0)
    try:
        server.ready_s = _wait_ready(proc, url, t0, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(proc: subprocess.Popen, url: str, t0: float, timeout_s: float) -> float:
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode}; see .bench/logs")
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server {url} not ready after {timeout_s} s")


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
