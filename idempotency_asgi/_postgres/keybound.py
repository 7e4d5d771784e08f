"""When a claim counts the tenant's stored keys against `max_keys` (`store.claim`).

Counting walks the tenant's keys, up to the bound: a millisecond or more per new key for a
busy tenant (15 ms at 100,000 keys not yet vacuumed), on the database every process shares.
So a process counts a tenant's keys at most once every `RECHECK_SECONDS`; in between it
remembers what it found:

- under the bound: plain claims, no count;
- over the bound: claims with a bound of 0, which refuse any key the tenant does not hold
  yet without counting anything, and still answer the keys it holds (replays, conflicts).

A tenant can so overshoot its bound by what it adds in one interval, per process: the bound
keeps one tenant from filling the table, it is not an exact quota.
"""

from __future__ import annotations

import time

#: How long a count of a tenant's keys is taken as true.
RECHECK_SECONDS = 1.0

#: Past this many tenants remembered, the oldest count is forgotten (every string can be a
#: tenant: the memory must not grow with them); a tenant forgotten is counted again.
_MAX_REMEMBERED = 10_000


class KeyBounds:
    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, bool]] = {}  # tenant: (counted at, over the bound)

    def bound_for(self, tenant: str, max_keys: int) -> int | None:
        """The bound to claim with: `max_keys` (count), 0 (known over: refuse new keys, count
        nothing), or None (known under: no bound in this claim)."""
        seen = self._seen.get(tenant)
        if seen is None or time.monotonic() - seen[0] >= RECHECK_SECONDS:
            return max_keys
        return 0 if seen[1] else None

    def counted(self, tenant: str, *, over: bool) -> None:
        """A claim with the full bound counted the tenant's keys (it made a new key, or was
        refused one)."""
        self._seen.pop(tenant, None)  # to the end: the dict stays in the order of counting
        while len(self._seen) >= _MAX_REMEMBERED:
            del self._seen[next(iter(self._seen))]
        self._seen[tenant] = (time.monotonic(), over)
