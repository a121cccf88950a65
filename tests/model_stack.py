"""Real tiny models behind a gateway, as real processes: what the fuzzers send the requests to
that only a real model answers (the chat template, structured output, tools, logit bias on
its vocabulary, embeddings).

    with model_stack(root) as running:
        running.urls["instance"], running.urls["embed"], running.urls["gateway"]

`strata serve` of the tiny random Llama (ChatML template; float32, one thread), `strata serve
--task embed` of the tiny BERT (both forked from one process that imported torch once:
tests/harness/serve_zygote.py), and `strata gateway --instances` over both (it routes by
`model`), all keyed as sim_stack's (a fuzzer's client key cannot drain them). Everything is
written by the tests: nothing is downloaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.procs import Proc, spawn
from harness.serve_zygote import ForkedServe, Zygote
from sim_stack import ADMIN_KEY, CLIENT_KEY, INTERNAL_KEY
from tiny_bert import make_tiny_bert_dir
from tiny_models import make_tiny_model_dir

MODEL = "fuzz-tiny"
EMBED_MODEL = "fuzz-embed"
_GATEWAY_READY = r"Strata gateway on (http://127\.0\.0\.1:\d+) "


@dataclass
class ModelTargets:
    instance: ForkedServe
    embed: ForkedServe
    gateway: Proc
    log_dir: Path

    @property
    def urls(self) -> dict[str, str]:
        return {"instance": self.instance.url, "embed": self.embed.url,
                "gateway": self.gateway.url}

    def errors(self) -> str:
        """What the processes logged at ERROR (with the traces that follow), for a failure's
        message: a 5xx's cause is in the log of whoever answered it."""
        found = []
        for log in sorted(self.log_dir.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith("ERROR")]
            for i in starts[:5]:
                found.append(f"{log.name}: " + "\n".join(lines[i:i + 40]))
        return "\n".join(found) or "no process logged an error"


@contextmanager
def model_stack(root: Path) -> Iterator[ModelTargets]:
    llama = make_tiny_model_dir(root / "tiny-llama", seed=3, initializer_range=0.2)
    bert = make_tiny_bert_dir(root / "tiny-bert")
    (root / "keys").write_text(CLIENT_KEY + "\n")
    (root / "admin-key").write_text(ADMIN_KEY + "\n")
    (root / "internal-key").write_text(INTERNAL_KEY + "\n")
    auth = ["--api-key-file", str(root / "keys"), "--admin-key-file", str(root / "admin-key"),
            "--internal-key-file", str(root / "internal-key")]
    common = ["--threads", "1", "--log-level", "warning", *auth]
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # both instances forked from one process that imported torch once, loading side by side
    with Zygote() as zygote:
        instance = zygote.start([str(llama), "--served-model-name", MODEL, "--dtype",
                                 "float32", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                                 *common], cache_dir=root / "cache", log=logs / "instance.log")
        embed = zygote.start([str(bert), "--task", "embed", "--served-model-name", EMBED_MODEL,
                              *common], cache_dir=root / "cache", log=logs / "embed.log")
        gateway = None
        try:
            instance.wait_ready(120)
            embed.wait_ready(120)
            argv = [sys.executable, "-m", "strata.cli", "gateway", "--instances", instance.url,
                    embed.url, "--port", "0", *auth]
            gateway = spawn("gateway", argv, logs)
            gateway.url = gateway.wait_for_output(_GATEWAY_READY, 60).group(1)
            yield ModelTargets(instance, embed, gateway, logs)
        finally:
            if gateway is not None:
                gateway.kill()
            embed.stop()
            instance.stop()


__all__ = ["EMBED_MODEL", "MODEL", "ModelTargets", "model_stack"]
