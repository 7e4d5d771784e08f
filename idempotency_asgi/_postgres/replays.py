"""Finished records served again from this process's memory (`replay_cache_seconds`).

A finished record does not change until it expires: a replay of one this process read a
moment ago need not cost a round trip. Each is kept for `seconds` at most (and never past
its own retention), in at most `max_bytes`, least recently used first out. What that gives
up, and why it is off unless asked for:

- a record deleted by hand (an operator freeing a key) is still replayed here for up to
  `seconds`;
- a replay is served while the database is away, for up to `seconds`: the answer is the
  recorded one, and nothing runs, but the store is no longer the only judge of it.

Only replays are served so (the same request, finished): a key in flight, a new key, or the
same key with another request always asks the database.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from datetime import datetime, timedelta, timezone

from .._keystore import Claim
from .._records import Outcome

#: A record whose retention ends sooner than this after it would leave the cache (by this
#: process's clock, which may differ from the database's by a little) is not kept.
_CLOCK_MARGIN = timedelta(seconds=5)

#: What one entry costs beyond its headers and body, in bytes (a rough count of the objects).
_OVERHEAD = 400


class ReplayCache:
    def __init__(self, *, seconds: float, max_bytes: int) -> None:
        self._seconds = seconds
        self._max_bytes = max_bytes
        # (tenant, key) -> (fingerprint, the replay's Claim, kept until, size)
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, Claim, float, int]] = OrderedDict()
        self._bytes = 0
        #: replays served from here, and looked for (for tests and operators)
        self.hits = 0
        self.lookups = 0

    def get(self, tenant: str, key: str, fingerprint: bytes) -> Claim | None:
        """The replay of this request, when this process read its record lately."""
        self.lookups += 1
        found = self._entries.get((tenant, key))
        if found is None:
            return None
        kept_fingerprint, claim, until, _ = found
        if time.monotonic() >= until or kept_fingerprint != fingerprint:
            # Stale, or another request on the key: the database answers that one.
            if time.monotonic() >= until:
                self._drop((tenant, key))
            return None
        self._entries.move_to_end((tenant, key))
        self.hits += 1
        return claim

    def put(self, tenant: str, key: str, fingerprint: bytes, claim: Claim) -> None:
        """Keep a replay the database just answered (a COMPLETED claim of this request)."""
        response = claim.response
        if claim.outcome is not Outcome.COMPLETED or response is None or response.body is None:
            return
        if claim.expires_at is None:
            return
        leaves = datetime.now(timezone.utc) + timedelta(seconds=self._seconds) + _CLOCK_MARGIN
        if claim.expires_at <= leaves:
            return  # its retention may end before it would leave: ask the database
        size = _OVERHEAD + len(response.body) + sum(len(n) + len(v) for n, v in response.headers)
        if size > self._max_bytes // 8:
            return  # one large answer must not push out the many small ones
        self._drop((tenant, key))
        while self._entries and self._bytes + size > self._max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[(tenant, key)] = (fingerprint, claim, time.monotonic() + self._seconds, size)
        self._bytes += size

    def _drop(self, entry: tuple[str, str]) -> None:
        found = self._entries.pop(entry, None)
        if found is not None:
            self._bytes -= found[3]
