"""Send hostile bodies (mutations.py) to a server and judge every answer.

Each mutant is POSTed on its own connection attempt with a deadline; its outcome is one of

    ok         2xx (a stream is read to its end)
    refused    4xx with an OpenAI error body ({"error": {"message": str, "type": str, ...}})
    busy       503 with an OpenAI error body (deliberate: no instance, draining, overloaded)
    bad_body   4xx or 503 whose body is not an OpenAI error body
    server     any other 5xx
    reset      the connection broke (refused, reset, closed without an answer)
    hang       no complete answer within `timeout_s`

and a run passes when nothing is bad_body, server, reset or hang (`FuzzReport.findings`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from harness.mutations import Mutant

GOOD = frozenset({"ok", "refused", "busy"})


@dataclass
class FuzzReport:
    counts: Counter[str] = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def num_sent(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, object]:
        return {"num_sent": self.num_sent, "outcomes": dict(sorted(self.counts.items())),
                "num_findings": len(self.findings), "findings": self.findings[:50],
                "elapsed_s": round(self.elapsed_s, 2)}


def is_error_body(content: bytes) -> bool:
    try:
        error = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str))


async def judge(client: httpx.AsyncClient, url: str, mutant: Mutant, timeout_s: float,
                headers: dict[str, str] | None = None) -> tuple[str, str]:
    """(outcome, detail) of one mutant."""
    request = client.build_request("POST", url + mutant.path, content=mutant.body,
                                   headers={"content-type": "application/json",
                                            **(headers or {})})
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.send(request, stream=True)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
    except TimeoutError:
        return "hang", f"no answer within {timeout_s}s"
    except httpx.HTTPError as exc:
        return "reset", f"{type(exc).__name__}: {exc}"
    status = response.status_code
    if status < 300:
        return "ok", str(status)
    if status < 500 or status == 503:
        if not is_error_body(content):
            return "bad_body", f"{status} {content[:200]!r}"
        return ("busy" if status == 503 else "refused"), str(status)
    return "server", f"{status} {content[:200]!r}"


async def run_fuzz(url: str, mutants: Iterable[Mutant], *, concurrency: int = 4,
                   timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> FuzzReport:
    """Send every mutant to `url` (at most `concurrency` at once) and judge the answers."""
    report = FuzzReport()
    started = time.perf_counter()
    queue: asyncio.Queue[Mutant] = asyncio.Queue()
    for mutant in mutants:
        queue.put_nowait(mutant)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            mutant = queue.get_nowait()
            outcome, detail = await judge(client, url, mutant, timeout_s, headers)
            report.counts[outcome] += 1
            if outcome not in GOOD:
                report.findings.append(f"{outcome}: {detail} <- {mutant.describe()}")

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    report.elapsed_s = time.perf_counter() - started
    return report


__all__ = ["FuzzReport", "is_error_body", "judge", "run_fuzz"]
