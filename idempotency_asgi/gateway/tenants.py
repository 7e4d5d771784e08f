"""Who a keyed request belongs to: keys are scoped to the tenant, so one caller's key never
answers another's request. A resolver returns None when it cannot tell, and the middleware
then answers 401 without forwarding anything."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.types import Scope

TenantResolver = Callable[[Scope], "str | None"]


def tenant_from_header(name: str) -> TenantResolver:
    """The value of a header set by a trusted layer in front (an API gateway's consumer id,
    an auth proxy's user id). That layer must strip the header from what clients send, or a
    client could name any tenant."""
    wanted = name.lower().encode("latin-1")

    def resolve(scope: Scope) -> str | None:
        for header, value in scope["headers"]:
            if header == wanted:
                tenant = value.decode("latin-1").strip()
                return tenant or None
        return None

    return resolve


def tenant_from_credential(
    header: str = "authorization", *, secret: str | None = None
) -> TenantResolver:
    """A digest of the credential the caller presented (`Authorization` by default): keys are
    scoped to whoever holds that credential, with no configuration. A rotated credential is a
    new tenant, whose keys start afresh.

    The digest is what the key table stores as the tenant. With `secret`, it is an HMAC, so a
    low-entropy credential (a Basic password) cannot be recovered from the table by guessing;
    without one, a SHA-256."""
    wanted = header.lower().encode("latin-1")
    key = secret.encode("utf-8") if secret else None

    def resolve(scope: Scope) -> str | None:
        for name, value in scope["headers"]:
            if name == wanted:
                credential = value.strip()
                if not credential:
                    return None
                if key is None:
                    return "sha256:" + hashlib.sha256(credential).hexdigest()
                return "hmac:" + hmac.new(key, credential, hashlib.sha256).hexdigest()
        return None

    return resolve
