"""A property test of the whole HTTP surface: schemathesis generates requests from the app's
own OpenAPI schema (valid and invalid bodies, odd path ids and headers) against a real gateway
and worker; no route may answer 5xx, whatever it is sent."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from pagedq.gateway.app import create_app  # noqa: E402
from pagedq.worker.config import GatewayConfig  # noqa: E402
from tests.gateway.harness import serve  # noqa: E402

SCHEMA = schemathesis.openapi.from_dict(create_app(GatewayConfig(api_keys=()), "redis://-")
                                        .openapi())
TRIED: list[str] = []
# examples per operation: the suite's budget; a longer run sets $PAGEDQ_FUZZ_EXAMPLES
EXAMPLES = int(os.environ.get("PAGEDQ_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_gateway(redis_url, queue, tiny_worker):
    # bounded work per request: a few prompts each, a few in the queue
    with serve(redis_url, queue=queue, max_prompts=4, max_files=1000) as gw:
        yield gw


@SCHEMA.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_5xx(case, fuzz_gateway):
    response = case.call(base_url=fuzz_gateway.base, timeout=120)
    TRIED.append(case.operation.label)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])


def test_report_examples_tried():
    """How many requests the run above sent (the figure in docs/operations.md)."""
    print(f"schemathesis: {len(TRIED)} requests over {len(set(TRIED))} operations at "
          f"{EXAMPLES} examples each, 0 5xx")
