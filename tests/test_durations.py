"""The Retry-After estimate's memory of routes: bounded, and the busy ones stay."""

from __future__ import annotations

from idempotency_asgi.durations import Durations


def test_a_busy_route_keeps_its_history_through_a_stream_of_new_ones():
    durations = Durations(max_routes=3)
    for _ in range(20):  # a steady 4 s route: its deviation settles near zero
        durations.observe("POST /payments", 4.0)
    for index in range(10):  # paths with ids in them: a new route each time
        durations.observe(f"POST /orders/{index}", 0.1)
        durations.observe("POST /payments", 4.0)
    hint = durations.retry_after("POST /payments", running_for=0.0, lease_remaining=10.0)
    # Kept: about 4 s. Forgotten and learned again from one request: 4 s plus half of it.
    assert 4.0 <= hint < 4.5
    forgotten = durations.retry_after("POST /orders/0", running_for=0.0, lease_remaining=10.0)
    assert forgotten == 1.0  # the least recently seen went
