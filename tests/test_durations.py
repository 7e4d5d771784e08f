"""The Retry-After estimate's memory of routes: bounded, and the busy ones stay."""

from __future__ import annotations

from idempotency_asgi._asgi.durations import Durations


def test_a_busy_route_keeps_its_history_through_a_stream_of_new_ones():
    durations = Durations(max_routes=3)
    for _ in range(20):  # a steady 4 s route: its deviation settles near zero
        durations.observe("POST /payments", 4.0)
    for index in range(10):  # paths with ids in them: a new route each time
        durations.observe(f"POST /orders/{index}", 0.1)
        durations.observe("POST /payments", 4.0)
    hint = durations.retry_after("POST /payments", running_for=0.0, lease_remaining=10.0)
    # Kept: about 4 s, in whole seconds rounded up. Forgotten and learned again from one
    # request, it would be 4 s plus half of it: 6.
    assert hint == 5
    forgotten = durations.retry_after("POST /orders/0", running_for=0.0, lease_remaining=10.0)
    assert forgotten == 1  # the least recently seen went


def test_the_hint_is_whole_seconds_and_never_beyond_a_fractional_lease():
    durations = Durations()
    durations.observe("POST /slow", 3.0)  # one sample: 3 s plus half of it
    assert durations.retry_after("POST /slow", running_for=0.0, lease_remaining=10.0) == 5
    # A 1.5 s lease: 2 would be beyond it, so 1 (never less than a second).
    assert durations.retry_after("POST /slow", running_for=0.0, lease_remaining=1.5) == 1
    assert durations.retry_after("POST /slow", running_for=0.0, lease_remaining=2.99) == 2
    assert durations.retry_after("POST /slow", running_for=4.9, lease_remaining=10.0) == 1
