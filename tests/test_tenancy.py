"""The tenant a request's headers name: the server's and the Ray ingress's one rule."""

from __future__ import annotations

from starlette.datastructures import Headers

from lora_guard.tenancy import header_tenant


def test_the_tenant_header_comes_before_a_gateways_fairness_id() -> None:
    both = Headers({"X-Tenant-Id": "gold", "X-Gateway-Inference-Fairness-Id": "bronze"})
    assert header_tenant(both) == "gold"
    assert header_tenant(Headers({"x-gateway-inference-fairness-id": "bronze"})) == "bronze"
    empty = Headers({"X-Tenant-Id": "", "X-Gateway-Inference-Fairness-Id": "bronze"})
    assert header_tenant(empty) == "bronze"
    assert header_tenant(Headers({"Accept": "text/plain"})) is None
