"""SQLAlchemy sessions in the request's transaction (`pip install 'idempotency-asgi[sqlalchemy]'`).

- `await session(request)`: the request's `AsyncSession`, working on the request's connection
  inside its transaction (the transactional and the atomic mode alike). In FastAPI,
  `session: idempotency_asgi.fastapi.Session` gives the same through `request_session`.
- `configure(sessions)`: the session factory to use, once, at startup (an
  `async_sessionmaker` with the options you want, or a SQLModel `AsyncSession` class's).

The session's transaction is a savepoint inside the request's: `await session.commit()`
releases it (the key's transaction goes on, and commits with the key's record when the
response is complete), `await session.rollback()` returns to it. What the session has sent
when the response is complete commits with the record, or rolls back with it. Its
`after_commit` listeners are called once the request's transaction has really committed,
never when it rolls back (see _sqlalchemy/events.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

try:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session
except ImportError as exc:  # pragma: no cover - tested in a subprocess without SQLAlchemy
    raise ImportError(
        "idempotency_asgi.sqlalchemy needs SQLAlchemy 2 with its asyncio extension: "
        "pip install 'idempotency-asgi[sqlalchemy]'"
    ) from exc

from starlette.requests import HTTPConnection

from . import after_commit, connection
from ._sqlalchemy import events
from ._sqlalchemy.driver import LentConnection
from ._sqlalchemy.engine import Engine

logger = logging.getLogger("idempotency_asgi")

#: Where a request's session is kept in its ASGI scope (one per request, as its connection).
SCOPE_KEY = "idempotency_asgi.sqlalchemy"

#: What `configure()` without arguments restores. `expire_on_commit=False`: a commit
#: releases a savepoint, nothing another transaction could change meanwhile, and an object
#: returned after it must still read its attributes when the response is rendered (an
#: expired one would load them again, and an AsyncSession cannot do that implicitly).
DEFAULT_SESSIONS: async_sessionmaker[AsyncSession] = async_sessionmaker(expire_on_commit=False)

_sessions: Callable[..., AsyncSession] = DEFAULT_SESSIONS
_engine = Engine()


#: Why a factory with per-model or per-table binds, or a routing session, is refused.
_BINDS_REFUSED = (
    "a session factory with `binds` (or a session class with a `get_bind` of its own) sends "
    "statements to other engines, outside the request's transaction (a write kept though "
    "the request fails, and made again by its retry): configure one without `binds`, whose "
    "session class routes nothing"
)


def configure(sessions: Callable[..., AsyncSession] | None = None) -> None:
    """Make the requests' sessions with `sessions`: an `async_sessionmaker` (any options:
    `class_=` a SQLModel `AsyncSession`, `expire_on_commit`, `autoflush`, `info`...), or any
    callable taking `bind=` and returning an `AsyncSession`. Its own `bind` is replaced by
    the request's connection; `binds` (per model or table) are refused, here and when a
    session is made: they would take statements out of the request's transaction. None
    restores `DEFAULT_SESSIONS`. Call it once, at startup."""
    global _sessions
    if sessions is not None and not callable(sessions):
        raise TypeError(f"configure() takes an async_sessionmaker, not {sessions!r}")
    if isinstance(sessions, async_sessionmaker) and (
        sessions.kw.get("binds") or _routes(sessions.kw.get("sync_session_class"))
    ):
        raise ValueError(_BINDS_REFUSED)
    _sessions = DEFAULT_SESSIONS if sessions is None else sessions


def _routes(session_class: Any) -> bool:
    """Whether a sync session class chooses its bind per statement (a routing session, its
    own `get_bind`) rather than using the one it is given."""
    own = getattr(session_class, "get_bind", Session.get_bind)
    return isinstance(session_class, type) and own is not Session.get_bind


def _has_binds(made: AsyncSession) -> bool:
    """Whether session `made` sends some statements to binds of its own (per model or
    table, or by a `get_bind` of its own) rather than to its one `bind`."""
    sync = made.sync_session
    if _routes(type(sync)):
        return True
    binds = getattr(sync, "binds", None)  # public from SQLAlchemy 2.1
    if binds is None:
        # SQLAlchemy 2.0 has no public way to read them: its Session keeps them in a private,
        # name-mangled attribute. Where that is missing too, a factory's binds are refused
        # by configure() only (tests/test_sqlalchemy_session.py covers each case).
        binds = getattr(sync, "_Session__binds", None)
    return bool(binds)


class _Opened:
    __slots__ = ("bind", "lent", "session")

    def __init__(self, session: AsyncSession, bind: AsyncConnection, lent: LentConnection):
        self.session = session
        self.bind = bind
        self.lent = lent


async def session(request: HTTPConnection) -> AsyncSession:
    """The request's SQLAlchemy session, inside its transaction (made on the first call;
    later calls in the same request return the same session).

    Raises what `idempotency_asgi.connection(request)` raises: RuntimeError outside a keyed
    request, TransactionEnded once its response is complete (a background task).
    """
    opened: _Opened | None = request.scope.get(SCOPE_KEY)
    if opened is None:
        lent = LentConnection(await connection(request), request)
        bind = await _engine.connect(lent)
        made = _sessions(bind=bind)
        if not isinstance(made, AsyncSession):
            raise TypeError(
                f"the configured session factory made {made!r}, not a SQLAlchemy AsyncSession"
            )
        if _has_binds(made):
            lent.release()  # nothing of this session may reach the connection
            raise ValueError(_BINDS_REFUSED)
        # Its after_commit listeners run when the request's transaction really commits.
        held: list[Callable[[], Any]] = []
        if not events.hold(made.sync_session, held):
            if events.listened(made.sync_session):
                lent.release()
                raise RuntimeError(events.LISTENERS_REFUSED)
        else:
            after_commit(request, functools.partial(_release_held, held))
        # A concurrent first call (a task group's children) may have made one meanwhile:
        # the request has one session, the first one kept.
        opened = request.scope.setdefault(SCOPE_KEY, _Opened(made, bind, lent))
    return opened.session


def _release_held(held: list[Callable[[], Any]]) -> None:
    """The session's after_commit calls, in the order SQLAlchemy made them (one per commit
    of the session's), now that the request's transaction has committed."""
    for call in held:
        try:
            call()
        except Exception:
            logger.exception("a SQLAlchemy after_commit listener failed")


async def request_session(request: HTTPConnection) -> AsyncIterator[AsyncSession]:
    """The FastAPI dependency behind `idempotency_asgi.fastapi.Session`: the request's
    session; rolled back to its last commit when the handler raises; closed after, without
    a round trip (and never touching the connection once the response is complete, which
    with a dependency's default scope has happened by then)."""
    made = await session(request)
    try:
        yield made
    except BaseException:
        # As `async with session.begin()` does: what the handler did since its last
        # commit is undone (a 4xx it raised is recorded with the rest of the request's
        # writes, not with these). A rollback that fails never hides why.
        with contextlib.suppress(Exception):
            await made.rollback()
        raise
    finally:
        await close(request)


async def close(request: HTTPConnection) -> None:
    """Close the request's session, if it has one, sending nothing: what it sent stays in
    the request's transaction (kept or rolled back with it); what it holds unflushed is
    dropped, with a warning. Safe to call more than once, and after the response."""
    opened: _Opened | None = request.scope.pop(SCOPE_KEY, None)
    if opened is None:
        return
    made = opened.session
    if made.new or made.deleted or any(made.is_modified(row) for row in made.dirty):
        logger.warning(
            "a request's SQLAlchemy session was closed holding changes it never flushed; "
            "they are not written: flush or commit the session before returning the response"
        )
    opened.lent.release()  # from here on nothing reaches the connection
    # Its objects detached, as a closed session's are. The session itself is not closed
    # through SQLAlchemy: that would only roll back what the release already made a no-op,
    # by way of SQLAlchemy's greenlet (a switch costs more than making the session), and
    # nothing of it needs closing: no pool, no connection of its own.
    made.expunge_all()


__all__ = ["DEFAULT_SESSIONS", "configure", "request_session", "session"]
