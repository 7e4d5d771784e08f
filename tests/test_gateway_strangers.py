"""The bound on tenants remembered as verified (strangers.py): least recently accepted first
out, so that a tenant the upstream keeps accepting is never pushed out by made-up
credentials, however many (it used to be first in, first out: 50,000 of them forgot it, and
its 4xx answers were no longer stored). The process-level behaviour (made-up credentials
store nothing) is in test_gateway_storage.py."""

from __future__ import annotations

from idempotency_asgi.gateway import strangers
from idempotency_asgi.gateway.strangers import Strangers


def test_a_tenant_the_upstream_keeps_accepting_is_never_forgotten(monkeypatch):
    monkeypatch.setattr(strangers, "MAX_VERIFIED", 100)
    remembered = Strangers()
    assert remembered.storable("regular", 201)
    for n in range(1000):
        # Every made-up credential that a public route answers 2xx is verified...
        assert remembered.storable(f"made-up-{n}", 200)
        if n % 50 == 0:
            # ...and the regular tenant is accepted again now and then.
            assert remembered.storable("regular", 200)
        assert remembered.storable("regular", 404)  # still verified: its 4xx is stored
    assert not remembered.storable("made-up-0", 404)  # long forgotten
    assert remembered.storable("made-up-999", 404)
    assert len(remembered._verified) == 100


def test_the_least_recently_accepted_goes_first(monkeypatch):
    monkeypatch.setattr(strangers, "MAX_VERIFIED", 3)
    remembered = Strangers()
    for tenant in ("a", "b", "c"):
        remembered.storable(tenant, 200)
    remembered.storable("a", 204)  # accepted again: now the most recent
    remembered.storable("d", 200)  # b goes, not a
    assert [remembered.storable(t, 400) for t in "abcd"] == [True, False, True, True]
    assert remembered.storable("e", 503)  # a 5xx frees the key anyway: stored never matters
    assert len(remembered._verified) == 3
