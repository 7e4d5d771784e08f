"""Storage for strangers: what a tenant the upstream never accepted may make the gateway keep.

With the tenant taken from the credential (`tenant_from_credential`), every string is a
tenant, and the gateway cannot know whether the upstream accepts it: an upstream that checks
credentials before routing answers 401 or 403 (which free the key), but Express, Starlette
and Django answer an unknown route 404 or 405 first, and any body may get a 400 or 422 before
anyone looks at the credential. Fifty made-up tokens stored fifty rows, each tenant up to
`max_keys_per_tenant` of them.

So a tenant counts as verified once the upstream has answered one of its keyed requests with
a 2xx, in this process; until then its other answers are passed on as they came but not
stored (the key is freed, as for a 5xx: a retry runs again), unless their status is one the
operator named (`unverified_statuses`). A 2xx is always stored, and verifies the tenant.

What this cannot know: a route that answers 2xx to anyone (a public form) verifies any
credential; a process restarted, or another worker, has to see a tenant's 2xx again before
storing its 4xx. A resolver that vouches for its tenants (`tenant_from_header`, behind an
auth layer that checks them; a resolver of one's own) verifies nobody: all of its tenants are
stored for.
"""

from __future__ import annotations

from collections.abc import Collection

#: Tenants remembered as verified, per process; past it, the one the upstream accepted least
#: recently is forgotten (and must be answered a 2xx again): a tenant in use is never pushed
#: out by a flood of made-up credentials, however many. Each is kept as a 64-bit hash: about
#: 100 bytes apiece.
MAX_VERIFIED = 50_000


class Strangers:
    """Which of a tenant's answers may be stored, by what the upstream said to it before."""

    def __init__(self, unverified_statuses: Collection[int] = ()) -> None:
        self._stored = frozenset(unverified_statuses)
        self._verified: dict[int, None] = {}

    def storable(self, tenant: str, status: int) -> bool:
        """Whether an answer of `status` to `tenant` may be stored (a 2xx verifies it)."""
        if 200 <= status <= 299:
            self._verify(hash(tenant))
            return True
        return status >= 500 or status in self._stored or hash(tenant) in self._verified

    def _verify(self, tenant: int) -> None:
        verified = self._verified
        if verified.pop(tenant, 0) is not None and len(verified) >= MAX_VERIFIED:
            # New, and the bound is reached: the least recently accepted goes (a dict keeps
            # its order of insertion, and every 2xx inserts its tenant again, at the end).
            del verified[next(iter(verified))]
        verified[tenant] = None
