"""Which tenant a request names in its headers: one rule for the server and the Ray ingress.

``X-Tenant-Id``, else the fairness id a Gateway API Inference Extension gateway's endpoint picker
keys its fairness by, else none (the server then uses ``default``; with API keys, the key's
tenant wins over both headers).
"""

from __future__ import annotations

from collections.abc import Mapping

TENANT_HEADER = "x-tenant-id"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


def header_tenant(headers: Mapping[str, str]) -> str | None:
    return headers.get(TENANT_HEADER) or headers.get(FAIRNESS_HEADER) or None
