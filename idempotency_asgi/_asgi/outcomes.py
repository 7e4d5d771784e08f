"""What an application's answer, or its exception, means for its key: the two rules every run
applies, in every mode (plain, two-phase, atomic), kept in one place so that each run asks
the same questions the same way.

- `recorded(status, release_statuses)`: whether an answer is the key's outcome, recorded and
  replayed to every retry, or passed on with the key freed for the next retry to run;
- `outcome_unknown_in(exc)`: whether the application said, anywhere in what it raised, that
  it cannot tell whether its effect happened: the key is then held, never freed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .._errors import OutcomeUnknown

#: "Send this request there" (RFC 9110, 15.4.8 and 15.4.9): the client is to send the same
#: method and body again, to another URL. Not what came of the request: recorded, the
#: redirected request (the same key on another path) would be answered 422 `key-reused`, and
#: every retry the redirect again, so a client that follows redirects would never succeed.
#: (A 301, 302 or 303 turns a POST into a GET: that is an answer, and recorded.)
SEND_IT_THERE = frozenset({307, 308})


def recorded(status: int, release_statuses: Collection[int]) -> bool:
    """Whether an answer of `status` is recorded as its key's outcome. Not a 5xx (the
    service failed: a retry should run), one of `release_statuses` (a refusal of the
    moment), or a 307 or 308 (ask there instead): those are passed on and the key freed."""
    return status < 500 and status not in SEND_IT_THERE and status not in release_statuses


def streamed(start: Mapping[str, Any]) -> bool:
    """Whether an answer's start (`http.response.start`) says it is an event stream: sent
    as it comes, its first event awaited by its client, and never replayed."""
    for name, value in start.get("headers", ()):
        if bytes(name).lower() == b"content-type":
            return bytes(value).lower().startswith(b"text/event-stream")
    return False


def outcome_unknown_in(exc: BaseException) -> OutcomeUnknown | None:
    """The first `OutcomeUnknown` in `exc` or anywhere behind it; None when there is none.

    Behind it is everything it was raised from (`__cause__`: `raise ... from unknown`) or
    while handling (`__context__`: `except OutcomeUnknown: raise ChargeFailed()`), and every
    member of an exception group (a task group's), to any depth. `raise ... from None`
    counts too: it hides the OutcomeUnknown from the traceback, but the effect it spoke of
    may still have happened, and holding the key costs a retry a wait where freeing it may
    cost a second charge. (An application that learned the outcome after all answers with a
    response instead of raising.)

    Each exception is looked at once, so a chain that loops (a group member raised from its
    own group) ends; and no Python recursion is involved, so no depth is too deep."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OutcomeUnknown):
            return current
        behind: list[BaseException] = []
        members = getattr(current, "exceptions", None)
        if isinstance(members, (tuple, list)):
            behind.extend(m for m in members if isinstance(m, BaseException))
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                behind.append(linked)
        pending.extend(reversed(behind))  # in the order written: members, cause, context
    return None
