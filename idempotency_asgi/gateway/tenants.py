"""Who a keyed request belongs to: keys are scoped to the tenant, so one caller's key never
answers another's request. A resolver returns None when it cannot tell, and the middleware
then answers 401 without forwarding anything.

Both resolvers here read one header, and say which (`header`): the gateway refuses a request
that carries it twice (a layer in front that appends its own value would otherwise lose to
the client's) or whose `Connection` header names it (it would be keyed by it, then strip it).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.types import Scope

TenantResolver = Callable[[Scope], "str | None"]
"""`tenant(scope)`: who a keyed request belongs to, or None (401, not forwarded). The two below
say which header they read, so the gateway can refuse a request that repeats it."""


class HeaderTenant:
    """A resolver that reads the tenant from one request header (`header`, lowercased).
    `vouched`: the header is set by a layer that checked who is asking (not so for a
    credential the gateway only digests: any string is a tenant then, see `strangers.py`)."""

    def __init__(
        self, header: str, derive: Callable[[bytes], str | None], *, vouched: bool
    ) -> None:
        self.header = header.lower().encode("latin-1")
        self.vouched = vouched
        self._derive = derive

    def __call__(self, scope: Scope) -> str | None:
        for name, value in scope["headers"]:
            if name == self.header:
                return self._derive(value)
        return None


def tenant_from_header(name: str) -> TenantResolver:
    """The value of a header set by a trusted layer in front (an API gateway's consumer id,
    an auth proxy's user id). That layer must strip the header from what clients send, or a
    client could name any tenant."""

    def derive(value: bytes) -> str | None:
        return value.decode("latin-1").strip() or None

    return HeaderTenant(name, derive, vouched=True)


def tenant_from_credential(
    header: str = "authorization", *, secret: str | None = None
) -> TenantResolver:
    """A digest of the credential the caller presented (`Authorization` by default): keys are
    scoped to whoever holds that credential, with no configuration. A rotated credential is a
    new tenant, whose keys start afresh.

    The digest is what the key table stores as the tenant. With `secret`, it is an HMAC, so a
    low-entropy credential (a Basic password) cannot be recovered from the table by guessing;
    without one, a SHA-256."""
    key = secret.encode("utf-8") if secret else None

    def derive(value: bytes) -> str | None:
        credential = value.strip()
        if not credential:
            return None
        if key is None:
            return "sha256:" + hashlib.sha256(credential).hexdigest()
        return "hmac:" + hmac.new(key, credential, hashlib.sha256).hexdigest()

    return HeaderTenant(header, derive, vouched=False)
