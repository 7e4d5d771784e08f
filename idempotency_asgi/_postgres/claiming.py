"""The claim: reserve a key for a request in one statement, or say what holds it (a finished
record to replay, a request in flight, another request's key), and take over a key whose
record expired or whose owner died.

Under load, concurrent claims share their statements (see batching.py), and retries of one
key that ask the same thing ride on one row: a storm of replays of one hot key costs a row a
batch, not a statement a request. A claim never waits on a lock that another key's request
holds (see sql/claiming.py), and a claim that got no answer, or whose request was cancelled
while its statement ran, frees what it may have reserved.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._errors import StatementUnanswered
from .._keystore import Claim
from .._records import (
    FORMAT_VERSION,
    Lease,
    Outcome,
    StoredResponse,
    decode_headers,
)
from . import sql
from .batching import Batcher
from .connections import time_left
from .database import UNREACHED, Database
from .keybound import KeyBounds
from .keyhash import key_lock, request_lock
from .replays import ReplayCache

#: Claim attempts before giving up. A claim repeats only when it lost a race (a row committed
#: after its snapshot, or a takeover won by another request): two are nearly always enough.
CLAIM_ATTEMPTS = 5

#: Rows one batched claim carries at most.
MAX_BATCH_ROWS = 64

#: What the path column keeps of a longer path: it is there to be read by a person.
_MAX_DIAGNOSTIC_CHARS = 2048

#: What a request riding on another's row hears when that one made the key: it is in flight.
_LOCKED = {"claimed": False, "state": "locked"}

#: What the claim on Citus answers when its INSERT made the key (see `Claims._routed`).
_CLAIMED = {"claimed": True}


def diagnostic_text(value: str) -> str:
    """`value` as a text column can hold it, for diagnostics only (the path): PostgreSQL
    text has no NUL, and a lone surrogate has no UTF-8, so both are written as escapes."""
    if len(value) > _MAX_DIAGNOSTIC_CHARS:
        value = value[:_MAX_DIAGNOSTIC_CHARS] + "..."
    if "\x00" in value or not value.isascii():
        value = value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return value


def new_token() -> int:
    # A random 63-bit token, not a counter: after a release deletes the row and a new request
    # claims the key again, a counter would restart and a stale owner could match it. It fences
    # this store's own runs and is never shown to a client, so it needs to be unique, not
    # unguessable: a generator of the store's own, seeded from the OS at import and again in a
    # forked child (the OS's own costs a system call per request, about 3 µs of the atomic
    # mode's). Not `random`'s shared one, which an application or a test may seed.
    return _TOKENS.getrandbits(63)


_TOKENS = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_TOKENS.seed)


@dataclass(frozen=True)
class Replaceable:
    """A row that another request may replace: a record past its retention (`expired`), or a
    request in flight for the same request whose owner's lease lapsed. `token` and `state`
    are the row's as read: whoever replaces it does so only if they still are."""

    expired: bool
    token: int
    state: str


def judge(row: Any, *, lease_seconds: float) -> Claim | Replaceable | None:
    """What a key's row, as a claim or a read answers it (see sql/rows.py), means: the
    Claim to answer, a Replaceable row, or None when the row was missed and the caller
    should look again."""
    if row is None or row is UNREACHED:
        return None
    if row["claimed"]:
        return Claim(Outcome.CLAIMED)
    state = row["state"]
    if state is None:
        return None  # the conflicting row is newer than the statement's snapshot
    if state == "locked":
        # An atomic transaction holds the key: in flight, for as long as nobody can tell.
        return Claim(Outcome.IN_FLIGHT, lease_remaining=lease_seconds, locked=True)
    if state == "absent":
        return Claim(Outcome.ABSENT)
    if state == "mismatch":
        return Claim(Outcome.MISMATCH)  # an atomic transaction runs another request on it
    if state == "over_limit":
        return Claim(Outcome.OVER_LIMIT)
    if state == "over_quota":
        return Claim(Outcome.OVER_QUOTA)
    if state == "completed" and row["expired"]:
        return Replaceable(expired=True, token=row["lease_token"], state=state)
    if not row["same_request"]:
        return Claim(Outcome.MISMATCH)
    if state == "completed":
        if row["format_version"] != FORMAT_VERSION:
            return Claim(Outcome.UNREADABLE)
        response = StoredResponse(
            status=row["response_status"],
            headers=decode_headers(row["response_headers"]),
            body=row["response_body"],
        )
        return Claim(Outcome.COMPLETED, response=response, expires_at=row["expires_at"])
    if row["lease_remaining"] > 0:
        return Claim(
            Outcome.IN_FLIGHT,
            lease_remaining=row["lease_remaining"],
            running_for=row["running_for"],
        )
    return Replaceable(expired=False, token=row["lease_token"], state=state)


class Claims:
    def __init__(
        self,
        db: Database,
        *,
        batch: bool,
        lanes: int,
        release_soon: Callable[[Lease, float], None],
        replays: ReplayCache | None = None,
    ) -> None:
        self._db = db
        self._replays = replays
        # How a claim that may have reserved its key for nobody frees it, in the background
        # (after a pause, in seconds).
        self._release_soon = release_soon
        self._key_bounds = KeyBounds()
        self.claims: Batcher[tuple[Any, ...], Any] | None = None
        self.peeks: Batcher[tuple[Any, ...], Any] | None = None
        if batch:
            self.claims = Batcher(
                self._claim_rows,
                key=_tenant_key,
                share=_same_claim,
                follow=_after_claim,
                lanes=lanes,
                max_size=MAX_BATCH_ROWS,
            )
            self.peeks = Batcher(
                self._peek_rows,
                key=_tenant_key,
                share=_same_peek,
                follow=_after_peek,
                lanes=lanes,
                max_size=MAX_BATCH_ROWS,
            )

    async def close(self) -> None:
        for batcher in (self.claims, self.peeks):
            if batcher is not None:
                await batcher.close()

    def bound_for(self, tenant: str, max_keys: int | None) -> int | None:
        return None if max_keys is None else self._key_bounds.bound_for(tenant, max_keys)

    def counted(self, tenant: str, *, over: bool) -> None:
        self._key_bounds.counted(tenant, over=over)

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
        """Reserve the key for this request, or say why not (see `PostgresStore.claim`)."""
        kept = self.replay(tenant, key, fingerprint)
        if kept is not None:
            return kept
        path = diagnostic_text(path)
        # One deadline for the whole claim (its retries and a takeover included): a request
        # is answered within the timeout, not within a timeout per step.
        deadline = asyncio.get_running_loop().time() + self._db.timeout
        bound = self.bound_for(tenant, max_keys)
        locks = key_lock(tenant, key), request_lock(tenant, key, fingerprint)
        spread = await self._db.spread(time_left(deadline))
        for _ in range(CLAIM_ATTEMPTS):
            token = new_token()
            args = (
                tenant,
                key,
                method,
                path,
                fingerprint,
                token,
                lease_seconds,
                ttl_seconds,
                FORMAT_VERSION,
                *locks,
            )
            lease = Lease(tenant=tenant, key=key, token=token, seconds=lease_seconds)
            if spread:
                row = await self._routed(lease, args, max_in_flight, bound, deadline=deadline)
            elif bound is not None:
                row = await self._alone(
                    lease, sql.CLAIM_BOUNDED, *args, max_in_flight, bound, deadline=deadline
                )
            elif max_in_flight is not None:
                row = await self._alone(
                    lease, sql.CLAIM_CAPPED, *args, max_in_flight, deadline=deadline
                )
            elif self.claims is not None:
                try:
                    row = await self.claims.submit(
                        args,
                        deadline=deadline,
                        abandoned=partial(self._claim_left, lease),
                        cut=partial(self._abandoned, lease),
                    )
                except StatementUnanswered:
                    self._abandoned(lease)
                    raise
            else:
                row = await self._alone(lease, sql.CLAIM, *args, deadline=deadline)
            seen = judge(row, lease_seconds=lease_seconds)
            if seen is None:
                continue  # the conflicting row is newer than our snapshot: look again
            counted = bound is not None and bound == max_keys  # a new key's claim counted
            if isinstance(seen, Claim):
                if counted and seen.outcome in (Outcome.CLAIMED, Outcome.OVER_QUOTA):
                    self.counted(tenant, over=seen.outcome is Outcome.OVER_QUOTA)
                if seen.outcome is Outcome.CLAIMED:
                    return Claim(Outcome.CLAIMED, lease=_at(lease, row.get("row_id")))
                self.keep(tenant, key, fingerprint, seen)
                return seen
            taken = await self._alone(
                lease, sql.TAKE_OVER, *args[:9], seen.token, *locks, deadline=deadline
            )
            if not taken["free"]:
                # An atomic transaction is replacing the row: in flight, as any locked key.
                return Claim(Outcome.IN_FLIGHT, lease_remaining=lease_seconds)
            if taken["taken"]:
                outcome = Outcome.EXPIRED if seen.expired else Outcome.TAKEN_OVER
                return Claim(outcome, lease=_at(lease, taken["row_id"]))
        # Lost every race in a row: someone else holds the key right now.
        return Claim(Outcome.IN_FLIGHT, lease_remaining=1.0)

    def replay(self, tenant: str, key: str, fingerprint: bytes) -> Claim | None:
        """The replay of this request from the cache of finished records, if it is there."""
        return None if self._replays is None else self._replays.get(tenant, key, fingerprint)

    def keep(self, tenant: str, key: str, fingerprint: bytes, claim: Claim) -> None:
        """A replay the database answered, for the cache of finished records."""
        if self._replays is not None:
            self._replays.put(tenant, key, fingerprint, claim)

    async def peek(
        self, *, tenant: str, key: str, fingerprint: bytes, deadline: float | None = None
    ) -> Any:
        """What holds the key, without claiming it (see sql/claiming.PEEK): a row for
        `judge`. Under load, peeks share statements, and peeks of one key ride on one row.
        Within the timeout, or by `deadline` (the loop's clock)."""
        args = (
            tenant,
            key,
            fingerprint,
            key_lock(tenant, key),
            request_lock(tenant, key, fingerprint),
        )
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self._db.timeout
        # Read first, whatever the batching: the atomic mode's lock follows what it says.
        spread = await self._db.spread(time_left(deadline))
        if self.peeks is not None and not spread:
            return await self.peeks.submit(args, deadline=deadline)
        return await self._db.call("fetchrow", sql.PEEK, *args, deadline=deadline, new_work=True)

    async def _routed(
        self,
        lease: Lease,
        args: tuple[Any, ...],
        max_in_flight: int | None,
        bound: int | None,
        *,
        deadline: float,
    ) -> Any:
        """The claim where the key table is distributed by Citus: a look at the key (with
        the tenant's limits), then, when nobody has it, the INSERT; each statement routed
        whole to the tenant's shard (see sql/claiming.INSERT_KEY). What the look saw, a
        claimed row, or None when another claim inserted the key in between."""
        look = (args[0], args[1], args[4], args[9], args[10])
        limits: tuple[int | None, ...]
        if bound is not None:
            statement, limits = sql.LOOK_BOUNDED, (max_in_flight, bound)
        elif max_in_flight is not None:
            statement, limits = sql.LOOK_CAPPED, (max_in_flight,)
        else:
            statement, limits = sql.PEEK, ()
        row = await self._db.call(
            "fetchrow", statement, *look, *limits, deadline=deadline, new_work=True
        )
        if row is None or row["state"] != "absent":
            return row
        inserted = await self._alone(
            lease, sql.INSERT_KEY, *args[:9], deadline=deadline, method="fetchval"
        )
        return _CLAIMED if inserted else None

    async def _alone(
        self, lease: Lease, statement: str, *args: Any, deadline: float, method: str = "fetchrow"
    ) -> Any:
        """One of the claim's statements on its own. One that got no answer, or whose request
        was cancelled while it ran, may have reserved the key: it is freed in the
        background, once a cancel sent meanwhile has had the time to land (before that the
        row is not visible, and a release would find nothing)."""
        try:
            return await self._db.call(method, statement, *args, deadline=deadline, new_work=True)
        except (StatementUnanswered, asyncio.CancelledError):
            self._abandoned(lease)
            raise

    def _abandoned(self, lease: Lease) -> None:
        """A claim got no answer (or its request went away while it ran): if it did reserve
        the key (a statement whose cancel is still on its way lands first), nobody would
        ever complete it, and every retry would get a 409 until the lease lapsed."""
        self._release_soon(lease, self._db.timeout)

    def _claim_left(self, lease: Lease, row: Any) -> None:
        """A claim's request stopped waiting while its batch was in flight: free what it got."""
        if row is not None and row is not UNREACHED and row["claimed"]:
            self._release_soon(lease, 0.0)

    async def _claim_rows(
        self, batch: Sequence[tuple[Any, ...]], timeout: float, wanted: Callable[[int], bool]
    ) -> list[Any]:
        # The one-row statement's arguments, but the format: it goes once, as $11.
        rows = [(*args[:8], *args[9:]) for args in batch]
        return await self._db.batched(
            batch,
            timeout,
            wanted,
            one=(sql.CLAIM, "fetchrow"),
            many=sql.CLAIM_MANY,
            columns=rows,
            extra=(FORMAT_VERSION,),
            result=lambda row: row,
            new_work=True,
        )

    async def _peek_rows(
        self, batch: Sequence[tuple[Any, ...]], timeout: float, wanted: Callable[[int], bool]
    ) -> list[Any]:
        return await self._db.batched(
            batch,
            timeout,
            wanted,
            one=(sql.PEEK, "fetchrow"),
            many=sql.PEEK_MANY,
            columns=batch,
            extra=(),
            result=lambda row: row,
            new_work=True,
        )


def _at(lease: Lease, row: Any) -> Lease:
    """`lease` with the ctid of the row its claim made, when the claim said it."""
    if row is None:
        return lease
    return Lease(
        tenant=lease.tenant, key=lease.key, token=lease.token, seconds=lease.seconds, row=row
    )


def _tenant_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return args[0], args[1]


def _same_claim(args: tuple[Any, ...]) -> Hashable:
    """Claims of one key that ask the same: method, path, fingerprint, lease, retention."""
    return args[2], args[3], args[4], args[6], args[7]


def _same_peek(args: tuple[Any, ...]) -> Hashable:
    fingerprint: bytes = args[2]
    return fingerprint


def _after_peek(row: Any) -> Any:
    """What a look riding on another's row hears: the same row, unless that one found the key
    free to run (no row, or one to replace): its request is about to run it, so this one is a
    duplicate in flight."""
    if row is None or row is UNREACHED:
        return row
    state = row["state"]
    if state == "absent" or (state == "completed" and row["expired"]):
        return _LOCKED
    if state == "in_flight" and row["same_request"] and row["lease_remaining"] <= 0:
        return _LOCKED
    return row


def _after_claim(row: Any) -> Any:
    """What a claim riding on another's row hears: the same row, unless that one made the
    key: then it is in flight."""
    if row is not None and row is not UNREACHED and row["claimed"]:
        return _LOCKED
    return row
