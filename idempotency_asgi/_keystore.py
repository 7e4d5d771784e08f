"""What the middleware needs from a key store: the persistence layer, as a protocol.

`PostgresStore` is the one there is. The middleware, a run (`_execution`), its heartbeat
(`_lease`) and the maintenance speak to a `KeyStore` only, so another backend would be a
module of its own implementing this, not edits across them. The claim is one conditional
write ("absent, or past its retention, or in flight under a lapsed lease"); everything that
changes a claimed key is fenced by the lease's token.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, Protocol

from ._records import Claim, Lease, StoredResponse


class RequestTransaction(Protocol):
    """One request's business transaction, committed together with its key's record."""

    #: whether the handler asked for its connection (the request is in transactional mode)
    used: bool

    async def connection(self) -> Any:
        """The handler's connection inside the transaction, opened on first use."""

    def broken(self) -> bool:
        """Whether the transaction's connection is gone (the database failed under it)."""

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Record the response and commit with it; None when the lease was lost."""

    async def close(self) -> None:
        """Roll back whatever is still open; safe to call more than once."""


class KeyStore(Protocol):
    """Idempotency records: claimed, completed or released under a lease, replayed."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def schema_revision(self) -> str | None:
        """The schema revision the store is at; None when its tables are not there."""

    async def claim(
        self,
        *,
        tenant: str,
        key: str,
        method: str,
        path: str,
        fingerprint: bytes,
        lease_seconds: float,
        ttl_seconds: float,
        max_in_flight: int | None = None,
        max_keys: int | None = None,
    ) -> Claim:
        """Reserve the key for this request, or say why not (see `Outcome`)."""

    async def wait(self, *, tenant: str, key: str, timeout: float) -> None:
        """Return when the key's in-flight request ends, or after `timeout`."""

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost."""

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        """Store the response if the lease still holds the key; when the record expires."""

    async def release(self, lease: Lease) -> None:
        """Give the key up (fenced by the lease's token)."""

    def release_soon(self, lease: Lease) -> None:
        """Give the key up in the background, trying again while the store is away."""

    def transaction(self) -> RequestTransaction:
        """A transaction for one request, opened only if its handler asks for it."""

    async def reap(self, *, batch_size: int) -> int: ...

    async def sweep(self, *, batch_size: int, grace_seconds: float) -> list[dict[str, Any]]: ...

    async def forget_leases(self, *, batch_size: int, grace_seconds: float) -> int: ...

    async def reap_processed(self, *, batch_size: int, retention_seconds: float) -> int: ...

    def exclusive(self, lock_id: int) -> AbstractAsyncContextManager[bool]:
        """Hold a lock among all the store's users while inside, if free (yields whether)."""
