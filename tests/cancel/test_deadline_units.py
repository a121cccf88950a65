"""The deadline's wire rules (strata/protocol/deadline.py) and what the gateway passes on."""

from __future__ import annotations

import pytest

from strata.errors import DeadlineExceededError, InvalidRequestError
from strata.gateway.path.deadline import with_remaining
from strata.protocol.deadline import TIMEOUT_HEADER, parse_timeout_s, request_timeout_s
from strata.protocol.errors import describe


@pytest.mark.parametrize(("value", "seconds"), [(None, None), (2, 2.0), (0.25, 0.25),
                                                ("1.5", 1.5), (" 3 ", 3.0)])
def test_a_timeout_is_positive_seconds(value: object, seconds: float | None) -> None:
    assert parse_timeout_s(value, "timeout") == seconds


@pytest.mark.parametrize("value", [0, -1, True, "soon", float("inf"), float("nan"), 86401,
                                   [1]])
def test_anything_else_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_timeout_s(value, TIMEOUT_HEADER)
    assert caught.value.param == TIMEOUT_HEADER


def test_the_header_wins_over_the_body() -> None:
    assert request_timeout_s("0.5", 30) == 0.5
    assert request_timeout_s(None, 30) == 30.0
    assert request_timeout_s(None, None) is None


def test_the_gateway_sends_what_remains_in_place_of_the_clients_header() -> None:
    headers = [("content-type", "application/json"), ("X-Strata-Timeout-S", "10")]
    assert with_remaining(headers, 100.0, 97.5) == [("content-type", "application/json"),
                                                   (TIMEOUT_HEADER, "2.500")]
    assert with_remaining(headers, 100.0, 101.0)[-1] == (TIMEOUT_HEADER, "0.001")
    assert with_remaining(headers, None, 97.5) is headers


def test_a_deadline_is_a_504_the_openai_client_does_not_retry() -> None:
    mapping = describe(DeadlineExceededError("late"))
    assert (mapping.status_code, mapping.type, mapping.code) == (504, "timeout_error",
                                                                 "deadline_exceeded")
    assert mapping.headers == {"x-should-retry": "false"}
