"""When each phase of one request happened in the engine, as plain data for tracing.

A request carries a `PhaseTimeline` only when the server traces it (`Request.timeline`); the
engine and the scheduler stamp it where the phase changes, behind one `is not None` check in
loops they already run, and the server turns it into spans once the request is over
(strata/server/phase_spans.py). Times are `time.time_ns()` (a span's clock), written by the engine
thread and read after the request's final output.

    arrived ─ queue wait ─ admitted ─ [kv import] ─ prefill chunk ... ─ first token ─ decode ─ end
                                       └ preempted ... admitted again (recomputes its tokens)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillChunk:
    start_ns: int
    end_ns: int
    num_tokens: int


@dataclass(slots=True)
class KVImportMark:
    at_ns: int
    end_ns: int
    num_blocks: int  # offered to the executor
    num_imported: int  # of them, written (the rest is recomputed)


@dataclass(slots=True)
class PhaseTimeline:
    clock_ns: Callable[[], int] = time.time_ns
    arrived_ns: int = 0
    admitted_ns: int | None = None  # the first admission: the end of the queue wait
    chunks: list[PrefillChunk] = field(default_factory=list)
    imports: list[KVImportMark] = field(default_factory=list)
    preemptions: list[tuple[int, int | None]] = field(default_factory=list)  # (at, readmitted)
    first_token_ns: int | None = None
    num_tokens: int = 0  # tokens appended here (a handed-over first token included)
    finished_ns: int | None = None
    finish: str = ""  # the final status's name
    _submitted_ns: list[int] = field(default_factory=list)  # chunks in flight, oldest first

    def __post_init__(self) -> None:
        self.arrived_ns = self.arrived_ns or self.clock_ns()

    def admitted(self) -> None:
        now = self.clock_ns()
        if self.admitted_ns is None:
            self.admitted_ns = now
        elif self.preemptions and self.preemptions[-1][1] is None:
            self.preemptions[-1] = (self.preemptions[-1][0], now)

    def preempted(self) -> None:
        self.preemptions.append((self.clock_ns(), None))
        self._submitted_ns.clear()  # its chunks in flight are dropped

    def chunk_submitted(self) -> None:
        self._submitted_ns.append(self.clock_ns())

    def chunk_done(self, num_tokens: int) -> None:
        now = self.clock_ns()
        start = self._submitted_ns.pop(0) if self._submitted_ns else now
        self.chunks.append(PrefillChunk(start, now, num_tokens))

    def kv_imported(self, started_ns: int, num_blocks: int, num_imported: int) -> None:
        self.imports.append(KVImportMark(started_ns, self.clock_ns(), num_blocks, num_imported))

    def token(self) -> None:
        self.num_tokens += 1
        if self.first_token_ns is None:
            self.first_token_ns = self.clock_ns()

    def finished(self, status: str) -> None:
        if self.finished_ns is None:
            self.finished_ns, self.finish = self.clock_ns(), status


__all__ = ["KVImportMark", "PhaseTimeline", "PrefillChunk"]
