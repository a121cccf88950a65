"""The scheduler's invariants, checked on demand (`Engine.check_integrity`, tests, the chaos
suite): the running set is running, and each request's tokens in flight are those of the batches
in flight, within its known tokens. A broken one raises RuntimeError naming it."""

from __future__ import annotations

from collections.abc import Iterable

from strata.engine.request import Request, RequestStatus


def check_scheduler(running: list[Request], requests: Iterable[Request],
                    in_flight: Iterable[list[tuple[Request, int]]]) -> None:
    """`running`: the scheduler's running list; `requests`: every request it holds;
    `in_flight`: the (request, tokens) entries of each batch in flight."""
    for request in running:
        if request.status != RequestStatus.RUNNING:
            raise RuntimeError(f"running_are_running: {request.request_id} is {request.status}")
    num_in_flight: dict[Request, int] = {}
    for scheduled in in_flight:
        for request, num_new in scheduled:
            num_in_flight[request] = num_in_flight.get(request, 0) + num_new
    for request in {*requests, *num_in_flight}:
        if request.num_in_flight_tokens != num_in_flight.get(request, 0):
            raise RuntimeError(
                f"in_flight_tokens_match_batches: {request.request_id} counts "
                f"{request.num_in_flight_tokens}, batches {num_in_flight.get(request, 0)}"
            )
        if request.num_computed_tokens + request.num_in_flight_tokens > request.num_tokens:
            raise RuntimeError(f"in_flight_within_known_tokens: {request.request_id}")
