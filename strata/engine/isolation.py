"""Failure isolation: a request that breaks the executor fails alone; a broken executor is fatal.

When executing a batch raises, the batch is split in two and each half executed again, down to
single sequences, until the sequences that fail on their own are found. That is sound because
the sequences of a `ModelInput` are independent: each writes only its own KV slots and reads
through its own block table, so running a subset computes what the whole batch would have
computed for it (a half that fails may have written some slots; they are rewritten, since a
failed sequence's results are never applied). The requests of the failed sequences end with
finish_reason "error"; the others get their tokens as if nothing had happened.

When no sequence of a batch can run on its own, the fault is the executor's, not a request's:
the executor's last error is raised again (with a note saying so) and ends the engine (its
process exits and its launcher restarts it):

    every sequence of a batch of two or more failed alone   -> fatal at once
    a batch of one failed, right after another such batch  -> fatal (two requests in a row
                                                              cannot both be at fault)
    a batch of one failed after a good batch               -> that request fails alone

An executor of one batch at a time is isolated this way: a plain `ModelExecutor`, and a
tensor-parallel one (one pipeline stage), whose ranks keep their collectives matched when one of
them cannot run its share of a step and tell rank 0 so (`ShareFailedError`, see
strata/model/parallel/rank.py): the halves then run on every rank again, and the sequence at
fault is dropped on every rank. An error that says the executor cannot go on
(`RankFailedError`: a rank died, or the ranks no longer agree) is fatal at once, without a
retry. For an `AsyncModelExecutor` with batches in flight (pipeline parallel) an error in
`submit` or `collect` stays fatal, as its contract says: a later batch in flight may already
read the KV of the failed one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.engine.executor import ModelExecutor, ModelInput, ModelOutput
from strata.errors import RankFailedError
from strata.types import RequestId

logger = logging.getLogger("strata.engine")
Execute = Callable[[ModelInput], ModelOutput]


@dataclass(slots=True)
class IsolatedOutput:
    """A batch's output; `failed` names the requests whose sequence could not run, and why."""

    output: ModelOutput
    failed: dict[RequestId, Exception] = field(default_factory=dict)


def execute_isolated(execute: Execute, model_input: ModelInput) -> IsolatedOutput:
    """Run `model_input`; when it raises, bisect it to find the sequences that fail alone
    (a `RankFailedError` is the executor's end, not a sequence's: raised as is)."""
    try:
        return IsolatedOutput(execute(model_input))
    except RankFailedError:
        raise
    except Exception as exc:
        sequences = model_input.sequences
        if len(sequences) == 1:
            return IsolatedOutput({}, {sequences[0].request_id: exc})
        half = len(sequences) // 2
        first = execute_isolated(execute, ModelInput(sequences[:half], model_input.block_size))
        second = execute_isolated(execute, ModelInput(sequences[half:], model_input.block_size))
        return IsolatedOutput(first.output | second.output, first.failed | second.failed)


class IsolatingRunner:
    """Runs batches through `execute_isolated` and decides when a failure is the executor's
    (see the module docstring); `num_failed_requests` counts requests failed alone."""

    def __init__(self, executor: ModelExecutor) -> None:
        self._executor = executor
        self._last_failed_whole = False
        self.num_failed_requests = 0

    def run(self, model_input: ModelInput) -> IsolatedOutput:
        result = execute_isolated(self._executor.execute, model_input)
        num_sequences = len(model_input.sequences)
        is_whole = bool(result.failed) and len(result.failed) == num_sequences
        if is_whole and (num_sequences > 1 or self._last_failed_whole):
            last = next(reversed(result.failed.values()))
            last.add_note(f"no sequence of a batch of {num_sequences} could run"
                          + (" (the second failed batch in a row)" if num_sequences == 1 else "")
                          + ": the executor is at fault, not a request")
            raise last
        self._last_failed_whole = is_whole
        for request_id, exc in result.failed.items():
            logger.error("request %s failed alone in the executor: %s: %s", request_id,
                         type(exc).__name__, exc)
        self.num_failed_requests += len(result.failed)
        return result


__all__ = ["IsolatedOutput", "IsolatingRunner", "execute_isolated"]
