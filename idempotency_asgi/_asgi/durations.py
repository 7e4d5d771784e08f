"""How long requests take, per route: the Retry-After of a 409 says when the first request is
likely done, not when its lease would lapse.

The lease is a bound for a dead owner, renewed while a live one runs: a 3-second request
under a 10-second lease would tell its duplicate "retry after 9", and a client that obeys
waits three times too long. Each worker instead keeps, per route, a smoothed duration of the
requests it recorded and its smoothed deviation (the way TCP estimates a round trip), and
answers with what is likely left of the first request: expected duration plus one deviation,
minus how long it has run (after one sample: one and a half times that sample). Never less
than a second, never beyond the lease. A route this worker has not seen yet gets a second: a
retry costs the server one statement.
"""

from __future__ import annotations

import math

#: Routes remembered per worker: paths that embed ids would otherwise grow without bound.
MAX_ROUTES = 1024

#: Weights of a new sample in the smoothed duration and in its deviation (TCP's 1/8, 1/4).
_MEAN_GAIN = 0.125
_DEVIATION_GAIN = 0.25


class Durations:
    def __init__(self, max_routes: int = MAX_ROUTES) -> None:
        self._max_routes = max_routes
        self._routes: dict[str, tuple[float, float]] = {}  # route -> (mean, deviation)

    def observe(self, route: str, seconds: float) -> None:
        """A request on `route` was recorded `seconds` after it was claimed."""
        known = self._routes.pop(route, None)  # put back last: the most recently seen
        if known is None:
            if len(self._routes) >= self._max_routes:
                del self._routes[next(iter(self._routes))]  # the least recently seen route
            self._routes[route] = (seconds, seconds / 2)
            return
        mean, deviation = known
        deviation += _DEVIATION_GAIN * (abs(seconds - mean) - deviation)
        mean += _MEAN_GAIN * (seconds - mean)
        self._routes[route] = (mean, deviation)

    def retry_after(self, route: str, *, running_for: float, lease_remaining: float) -> int:
        """Whole seconds until a request on `route` that has run `running_for` is likely
        done: rounded up, so a client that obeys does not come back a moment too early, but
        never beyond `lease_remaining` (rounded down: a 1.5 s lease never says 2)."""
        known = self._routes.get(route)
        left = 0.0 if known is None else known[0] + known[1] - running_for
        return max(1, min(math.ceil(left), math.floor(lease_remaining)))
