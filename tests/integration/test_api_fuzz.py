"""The router's OpenAPI document against the router: schemathesis sends generated requests (valid
and invalid bodies, odd types, boundary values) to every documented operation of the tiny
fleet's router and checks that none gets a 5xx, that every status code and content type is
one the document declares, and that every answer matches its declared schema. Then the fleet's
processes must all be the ones that were running before: nothing crashed or restarted."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.support import RunningFleet

pytestmark = pytest.mark.integration

# Generated requests per operation and mode; ``SHOAL_FUZZ_EXAMPLES`` raises it for a longer run.
EXAMPLES = int(os.environ.get("SHOAL_FUZZ_EXAMPLES", "400"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_every_documented_operation_answers_as_documented(tiny_fleet: RunningFleet) -> None:
    pids = tiny_fleet.fleet.pids()
    schema = schemathesis.openapi.from_url(tiny_fleet.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/livez",
        "/readyz",
    }
    sent = 0
    for operation in operations:
        for mode in GenerationMode:
            # Valid requests, then (for the operations that take a body) requests that break the
            # schema: wrong types, missing or extra fields, out-of-range values.
            if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
                continue

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
            )
            def call(case: schemathesis.Case) -> None:
                nonlocal sent
                sent += 1
                case.call_and_validate(checks=CHECKS, timeout=60)

            call()
    print(f"{sent} generated requests over {len(operations)} operations")
    assert sent >= 2 * len(operations)
    # Nothing crashed or restarted, and the fleet still serves.
    assert tiny_fleet.fleet.pids() == pids
    reply = httpx.post(
        tiny_fleet.base_url + "/v1/completions",
        json={"model": tiny_fleet.model, "prompt": [1, 2], "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
