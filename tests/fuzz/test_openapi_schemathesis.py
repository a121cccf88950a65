"""The OpenAPI documents of the instance and the gateway describe every route of their route
tables (a new route cannot go undocumented), and Schemathesis, generating requests from them
(valid and invalid), finds no 5xx, no answer outside the documented statuses, content types and
schemas, against real keyed processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from sim_stack import CLIENT_KEY, Targets, sim_stack
from starlette.routing import Route

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.openapi_routes import GATEWAY_OPERATIONS
from strata.gateway.routing.sources import StaticSource
from strata.protocol.openapi import Operation
from strata.server.app import build_routes as instance_routes
from strata.server.openapi_routes import INSTANCE_OPERATIONS


def not_a_server_error_but_its_deadline(ctx: Any, response: Any, case: schemathesis.Case
                                        ) -> bool | None:
    """A 504 `deadline_exceeded` for a request that set its own deadline (a body `timeout` of a
    microsecond, say) is the answer it asked for; any other 5xx is a failure."""
    is_asked = isinstance(case.body, dict) and case.body.get("timeout") is not None
    if is_asked and response.status_code == 504 and b'"deadline_exceeded"' in response.content:
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [not_a_server_error_but_its_deadline, status_code_conformance,
          content_type_conformance, response_schema_conformance]
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
EXAMPLES = 12  # per operation: ~25 operations, well under a minute per document here


def table(routes: list[object]) -> set[tuple[str, str]]:
    return {(m, r.path) for r in routes if isinstance(r, Route) for m in r.methods or ()
            if m != "HEAD"}


def documented(operations: tuple[Operation, ...]) -> set[tuple[str, str]]:
    return {(op.method, op.path) for op in operations}


def test_every_route_is_documented_and_every_document_entry_is_a_route() -> None:
    assert documented(INSTANCE_OPERATIONS) == table(instance_routes())
    source = StaticSource(("http://127.0.0.1:9",), httpx.AsyncClient())
    gateway = create_gateway_app(GatewayConfig(), source, run_background=False)
    assert documented(GATEWAY_OPERATIONS) == table(gateway.routes)


@pytest.fixture(scope="module")
def keyed_targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    with sim_stack(tmp_path_factory.mktemp("schemathesis"), keyed=True) as running:
        yield running


def run_schemathesis(url: str, timeout_s: float = 15.0) -> tuple[int, list[str]]:
    """Every operation of the document at `url`, EXAMPLES generated cases each (Schemathesis's
    strategies driven by Hypothesis here, without its pytest plugin); (cases sent, failures)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    sent, failures = 0, []
    for result in schema.get_all_operations():
        operation = result.ok()

        @SETTINGS
        @given(case=operation.as_strategy())
        def one(case: schemathesis.Case) -> None:
            nonlocal sent
            sent += 1
            case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=timeout_s)

        try:
            one()
        except Exception as exc:  # a check failed: name the operation, keep going
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}"[:2000])
    return sent, failures


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_schemathesis_finds_nothing(keyed_targets: Targets, target: str) -> None:
    sent, failures = run_schemathesis(keyed_targets.urls[target])
    assert failures == []
    assert sent >= EXAMPLES * 5
