"""The gateway: idempotency for an HTTP service written in anything.

    from idempotency_asgi.gateway import build_gateway, tenant_from_header

    app = build_gateway(
        "http://127.0.0.1:9000",
        store=PostgresStore(dsn),
        tenant=tenant_from_header("X-Consumer-Id"),
    )

It needs the `gateway` extra (httpx, uvicorn): `pip install 'idempotency-asgi[gateway]'`. The
names load on first use, so that `idempotency-asgi migrate` and the other commands work
without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Gateway, build_gateway
    from .options import DEFAULT_HEALTH_PATH
    from .proxy import UpstreamOutcomeUnknown
    from .tenants import TenantResolver, tenant_from_credential, tenant_from_header

__all__ = [
    "DEFAULT_HEALTH_PATH",
    "Gateway",
    "TenantResolver",
    "UpstreamOutcomeUnknown",
    "build_gateway",
    "tenant_from_credential",
    "tenant_from_header",
]

_HOMES = {
    "DEFAULT_HEALTH_PATH": "options",
    "Gateway": "app",
    "TenantResolver": "tenants",
    "UpstreamOutcomeUnknown": "proxy",
    "build_gateway": "app",
    "tenant_from_credential": "tenants",
    "tenant_from_header": "tenants",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
