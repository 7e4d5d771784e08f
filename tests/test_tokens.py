"""The store's lease tokens and run marks (`claiming.new_token`): drawn from a generator of
the store's own, so that no seeding of Python's shared one (an application's, a test
framework's) and no fork makes two owners of a key draw the same token."""

from __future__ import annotations

import os
import random

import pytest

from idempotency_asgi._postgres.claiming import new_token


def test_seeding_pythons_shared_generator_does_not_repeat_tokens() -> None:
    random.seed(0)
    first = [new_token() for _ in range(4)]
    random.seed(0)
    second = [new_token() for _ in range(4)]
    assert set(first).isdisjoint(second)
    assert all(0 <= token < 2**63 for token in first + second)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_draws_other_tokens_than_its_parent() -> None:
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its tokens, to the parent, and out without pytest's teardown
        try:
            os.write(writing, ",".join(str(new_token()) for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading) as pipe:
        child = [int(token) for token in pipe.read().split(",")]
    os.waitpid(pid, 0)
    parent = [new_token() for _ in range(4)]
    assert set(child).isdisjoint(parent), (child, parent)
