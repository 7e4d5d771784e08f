"""The request session's `after_commit` listeners, held until the request's real COMMIT.

An application sends its e-mails and publishes its events from a session's `after_commit`
listener, because SQLAlchemy calls it once the session's transaction has committed. The
request's session commits a savepoint, not the request's transaction (see
idempotency_asgi.sqlalchemy): SQLAlchemy would call the listener then, and again on every
retry of a request that then failed and rolled back. So the call is held, and made, with the
same session, once the request's transaction has really committed (`after_commit`), never if
it rolls back.

SQLAlchemy has no public way to hold an event: its session calls
`self.dispatch.after_commit(self)`, and `dispatch` is the instance's own attribute (made on
first use and kept in its `__dict__`, see sqlalchemy.event.base.dispatcher). The request's
session gets a dispatch of its own that passes everything through but `after_commit`, whose
calls it keeps. Where a SQLAlchemy version keeps its dispatch otherwise (`hold` returns
False), a session with `after_commit` listeners is refused with an error that says what to
do instead (tests/test_sqlalchemy_events.py covers both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Why a session whose `after_commit` listeners cannot be held is refused.
LISTENERS_REFUSED = (
    "this SQLAlchemy version's session events cannot be held until the request's real "
    "COMMIT, and an after_commit listener would run for a commit that may never happen: "
    "schedule the work with idempotency_asgi.after_commit(request, fn) instead"
)


class _Held:
    """A listener collection as the session sees it: calling it keeps the call."""

    __slots__ = ("_calls", "_listeners")

    def __init__(self, listeners: Any, calls: list[Callable[[], Any]]) -> None:
        self._listeners = listeners
        self._calls = calls

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        listeners = self._listeners
        self._calls.append(lambda: listeners(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._listeners, name)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def __iter__(self) -> Any:
        return iter(self._listeners)

    def __len__(self) -> int:
        return len(self._listeners)


class _Dispatch:
    """The session's dispatch, `after_commit` held (see the module)."""

    __slots__ = ("_calls", "_dispatch")

    def __init__(self, dispatch: Any, calls: list[Callable[[], Any]]) -> None:
        self._dispatch = dispatch
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._dispatch, name)
        return _Held(found, self._calls) if name == "after_commit" else found


def hold(sync_session: Any, calls: list[Callable[[], Any]]) -> bool:
    """Hold the `after_commit` calls of `sync_session` (a Session) in `calls`; False when
    this SQLAlchemy's session keeps its dispatch where it cannot be replaced."""
    state = getattr(sync_session, "__dict__", None)
    if state is None or not hasattr(type(sync_session), "dispatch"):
        return False
    dispatch = sync_session.dispatch  # made now, if it was not yet, and kept in __dict__
    if state.get("dispatch") is not dispatch:
        return False
    state["dispatch"] = _Dispatch(dispatch, calls)
    return True


def listened(sync_session: Any) -> bool:
    """Whether anything listens for the session's `after_commit`."""
    return bool(sync_session.dispatch.after_commit)
