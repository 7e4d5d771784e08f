"""Finished records served again from this process's memory (`replay_cache_seconds`).

A finished record does not change until it expires: a replay of one this process read a
moment ago need not cost a round trip. Each is kept for `seconds` at most (and never past
its own retention), in at most `max_bytes`, least recently used first out. What an entry
costs is counted with its objects (each header is a tuple and two bytes objects, about 130
bytes before its text): counting only its bytes, answers of 16,000 short headers grew the
process by 895 MiB for a 32 MiB bound, and typical answers were undercounted 2.3 times. An
entry past its `seconds` leaves then (a timer sweeps them), not only when the cache is full
or the key asked for again. What the cache gives up, and why it is off unless asked for:

- a record deleted by hand (an operator freeing a key) is still replayed here for up to
  `seconds`;
- a replay is served while the database is away, for up to `seconds`: the answer is the
  recorded one, and nothing runs, but the store is no longer the only judge of it.

Only replays are served so (the same request, finished): a key in flight, a new key, or the
same key with another request always asks the database.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

from .._keystore import Claim
from .._records import Outcome

#: A record whose retention ends sooner than this after it would leave the cache (by this
#: process's clock, which may differ from the database's by a little) is not kept.
_CLOCK_MARGIN = timedelta(seconds=5)

#: What one entry costs beyond the objects `_footprint` counts one by one: its place in the
#: dictionary and in the expiry queue, the key and value tuples, the Claim, its
#: StoredResponse, its datetime and float (measured with tracemalloc: about 700 bytes).
_OVERHEAD = 800


class ReplayCache:
    def __init__(self, *, seconds: float, max_bytes: int) -> None:
        self._seconds = seconds
        self._max_bytes = max_bytes
        # (tenant, key) -> (fingerprint, the replay's Claim, kept until, size)
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, Claim, float, int]] = OrderedDict()
        # (kept until, entry) in the order they were put, so in the order they go stale (all
        # are kept for `seconds`); an entry put again is found by its time, not removed here.
        self._expiries: deque[tuple[float, tuple[str, str]]] = deque()
        self._sweeping: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
        self._bytes = 0
        #: replays served from here, and looked for (for tests and operators)
        self.hits = 0
        self.lookups = 0

    @property
    def size(self) -> int:
        """What the entries held now cost, in bytes, as counted against `max_bytes`."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tenant: str, key: str, fingerprint: bytes) -> Claim | None:
        """The replay of this request, when this process read its record lately."""
        self.lookups += 1
        now = time.monotonic()
        self._expire(now)
        found = self._entries.get((tenant, key))
        if found is None:
            return None
        kept_fingerprint, claim, until, _ = found
        if now >= until or kept_fingerprint != fingerprint:
            # Stale, or another request on the key: the database answers that one.
            if now >= until:
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
        size = _footprint(tenant, key, fingerprint, response.headers, response.body)
        if size > self._max_bytes // 8:
            return  # one large answer must not push out the many small ones
        now = time.monotonic()
        self._expire(now)
        self._drop((tenant, key))
        while self._entries and self._bytes + size > self._max_bytes:
            self._drop(next(iter(self._entries)))
        until = now + self._seconds
        self._entries[(tenant, key)] = (fingerprint, claim, until, size)
        self._expiries.append((until, (tenant, key)))
        self._bytes += size
        self._sweep_later()

    def _expire(self, now: float) -> None:
        """Drop every entry whose time is up (the oldest first: they are queued in order)."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            until, entry = expiries.popleft()
            found = self._entries.get(entry)
            if found is not None and found[2] == until:
                self._drop(entry)

    def _sweep_later(self) -> None:
        """Arm a timer for the oldest entry's time, so that stale entries leave on time even
        when nothing is asked of the cache (outside an event loop, `get` and `put` sweep)."""
        if not self._expiries:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._sweeping is not None and self._sweeping[0] is loop:
            return  # armed already (a timer armed in a loop since closed is armed again here)
        delay = max(0.0, self._expiries[0][0] - time.monotonic())
        self._sweeping = loop, loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        self._sweeping = None
        self._expire(time.monotonic())
        self._sweep_later()

    def _drop(self, entry: tuple[str, str]) -> None:
        found = self._entries.pop(entry, None)
        if found is not None:
            self._bytes -= found[3]


def _footprint(
    tenant: str,
    key: str,
    fingerprint: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
) -> int:
    """What an entry holds in memory, object by object (sys.getsizeof), plus `_OVERHEAD`."""
    size = sys.getsizeof
    total = _OVERHEAD + size(tenant) + size(key) + size(fingerprint) + size(body) + size(headers)
    for header in headers:
        total += size(header) + size(header[0]) + size(header[1])
    return total
