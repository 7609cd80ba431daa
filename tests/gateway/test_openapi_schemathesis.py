"""schemathesis against the gateway's own ``/openapi.json`` (issue 27): requests generated from
the document — valid, and invalid on purpose — get the statuses, content types and bodies it
declares, what it calls invalid is refused (``negative_data_rejection``), and no request is a 500.
Not checked: that every schema-valid body is accepted (``positive_data_acceptance``): the gateway
refuses by value what no engine serves (``best_of`` > 1, audio, an unknown role …: 400 naming the
field, docs/gateway.md) and the engine refuses values of the fields it is sent verbatim, which the
document's types do not express. The pool's sim engine answers fast
and the gateway's request timeout is short, so a valid request for many tokens ends as the
documented 504, not as a long wait."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import load_all_checks

from bear.gateway.openai_types import Defaults, openapi_document
from bear.gateway.server import GatewayConfig

from gateway_helpers import KEY, ThreadedPool

load_all_checks()
schema = schemathesis.openapi.from_dict(openapi_document())
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    cfg = GatewayConfig(request_timeout_s=2.0, body_timeout_s=1.0, defaults=Defaults(max_tokens=4))
    tp = ThreadedPool(tmp_path_factory.mktemp("schemathesis"), gateway_cfg=cfg,
                      profiles={"sim-small": "qwen3-0.6b-h100"})
    yield tp.pool.base_url.removesuffix("/v1")
    tp.close()


def not_a_bug(ctx, response, case) -> None:  # type: ignore[no-untyped-def]
    """503 and 504 are the pool's declared answers (no instance, a request timeout); 500 is a bug."""
    assert response.status_code != 500, response.text[:300]


@schema.parametrize()
# derandomized: CI runs the same 40 cases every time (random draws found a real 500 in 2 of 9 runs,
# fixed, but a test that passes or fails by the draw cannot gate a submission)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_gateway_conforms_to_its_openapi_document(root, case) -> None:  # type: ignore[no-untyped-def]
    from schemathesis.checks import CHECKS

    by_name = {f.__name__: f for f in CHECKS.get_all()}
    case.call_and_validate(base_url=root, headers=AUTH, timeout=60,
                           excluded_checks=[by_name["not_a_server_error"], by_name["positive_data_acceptance"]], additional_checks=[not_a_bug])
