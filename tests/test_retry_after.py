"""The Retry-After of a 409 comes from how long the route's recorded requests really took.

Each middleware learns its routes' durations from the requests it records (durations.py): a
route whose requests take 1.6 s is expected to take 1.6 + 0.8 s, so a duplicate that arrives
0.9 s into the first request hears "2", where a route nothing is known about hears "1" and the
lease (30 s here) would say far more. The durations are fed by real requests on real PostgreSQL.
"""

from __future__ import annotations

import asyncio

from tests.apps import build_app
from tests.helpers import assert_problem, claimed, client, effects, headers, new_key

#: How long the slow requests take: the estimate after one of them is 1.5 times this.
SLOW_MS = "1600"


async def _duplicate_of_a_slow_request(http, db, tenant, path, *, after: float):
    """A duplicate sent `after` seconds into a slow request on `path`; its 409, and the
    first request's answer."""
    key = new_key()
    first = asyncio.create_task(
        http.post(path, json={}, headers=headers(tenant, key, x_delay_ms=SLOW_MS))
    )
    await claimed(db, tenant, key)
    await asyncio.sleep(after)
    duplicate = await http.post(path, json={}, headers=headers(tenant, key))
    return duplicate, await first


async def test_a_409_says_what_is_left_of_the_routes_recorded_duration(schema, db, tenant):
    app = build_app(schema, lease_seconds=30)
    async with client(app) as http:
        # One recorded request teaches the route: about 1.6 s.
        taught = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, new_key(), x_delay_ms=SLOW_MS)
        )
        assert taught.status_code == 201
        duplicate, first = await _duplicate_of_a_slow_request(
            http, db, tenant, "/tx/charge", after=0.9
        )
        # Another route has recorded nothing: a duplicate there hears the shortest hint.
        cold, _ = await _duplicate_of_a_slow_request(http, db, tenant, "/tx/other", after=0.9)
    assert first.status_code == 201
    assert_problem(duplicate, 409, "request-in-progress")
    assert_problem(cold, 409, "request-in-progress")
    # 1.6 s expected plus 0.8 s of deviation, less the 0.9 s already run: about 1.5, so 2.
    # A constant 1 (nothing learned) and the whole estimate (3: the time already run not
    # taken off) are both wrong, as is anything near the 30 s lease.
    assert duplicate.headers["retry-after"] == "2"
    assert cold.headers["retry-after"] == "1"
    assert await effects(db, tenant) == 3


async def test_a_409_never_says_more_than_the_lease_has_left(schema, db, tenant):
    # The route is known to take about 2.4 s (with its deviation), longer than the 2.5 s
    # lease has left once the request has started: the answer is what the lease has left,
    # rounded down (2), neither the estimate (3) nor the constant 1.
    app = build_app(schema, lease_seconds=2.5)
    async with client(app) as http:
        taught = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, new_key(), x_delay_ms=SLOW_MS)
        )
        assert taught.status_code == 201
        duplicate, first = await _duplicate_of_a_slow_request(
            http, db, tenant, "/tx/charge", after=0.0
        )
    assert first.status_code == 201
    assert_problem(duplicate, 409, "request-in-progress")
    assert duplicate.headers["retry-after"] == "2"
