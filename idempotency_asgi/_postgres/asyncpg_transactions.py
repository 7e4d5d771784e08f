"""asyncpg's own view of a transaction the store begins or ends with statements of its own.

The store's round trips put a BEGIN, a COMMIT or a ROLLBACK beside statements of its own (a
claim, a record, the locks let go of) in one simple query. asyncpg keeps its own account of a
connection's transaction (whether `conn.transaction()` begins one or takes a savepoint), which
those statements would leave wrong; this module keeps it right. asyncpg has no public way to do
so, so it sets asyncpg's private state as its own calls do; where that state is not there (an
asyncpg that changed it), each call falls back to asyncpg's own transaction calls and a round
trip more (tested in tests/test_asyncpg_fallback.py, with private_transaction_state() made
None)."""

from __future__ import annotations

from typing import Any

import asyncpg

from .sql.onecommit import Ending

#: asyncpg's client-side timeout for a COMMIT: never, in effect. Without one it applies the
#: connection's `command_timeout`, and its timeout cancels the statement on the server, which
#: a COMMIT must never be (the caller bounds its own wait instead).
COMMIT_TIMEOUT = 1e9


def commit_timeout(conn: Any) -> float | None:
    """The timeout= to give a statement that commits on `conn`: None (no timer at all) where
    the connection has no `command_timeout` to apply, COMMIT_TIMEOUT where it has one or this
    asyncpg does not say. (asyncpg starts a timer for any timeout given; whether the
    connection has a command_timeout is in its private `_config`: where that is missing, the
    timer is the cost, never a cancelled COMMIT.)"""
    config = getattr(getattr(conn, "_con", conn), "_config", None)
    if config is not None and getattr(config, "command_timeout", 0) is None:
        return None
    return COMMIT_TIMEOUT


async def commit_with(tx: Any, statements: str) -> bool:
    """Commit asyncpg transaction `tx` by running `statements` (a simple-query string that
    starts with COMMIT) in one round trip, keeping asyncpg's own view of the transaction right:
    afterwards `tx` is committed (or failed) as if `tx.commit()` had run.

    False, having run nothing, when `tx` is not a plain top-level transaction this asyncpg
    version lets us finish that way (the caller then commits it the ordinary way)."""
    return await _finish_with(tx, statements, "COMMITTED")


async def rollback_with(tx: Any, statements: str) -> bool:
    """Roll back asyncpg transaction `tx` by running `statements` (a simple-query string that
    starts with ROLLBACK) in one round trip, as `commit_with` commits; False, having run
    nothing, when this asyncpg version does not let us (the caller rolls back the ordinary
    way)."""
    return await _finish_with(tx, statements, "ROLLEDBACK")


def private_transaction_state() -> Any:
    """asyncpg's private enum of a transaction's states, or None where this asyncpg has none
    (begin_with, commit_with and rollback_with then fall back to asyncpg's own calls)."""
    return getattr(asyncpg.transaction, "TransactionState", None)


async def _finish_with(tx: Any, statements: str, ended: str) -> bool:
    # Private state, set as asyncpg's own commit() and rollback() set it (see the module).
    state: Any = private_transaction_state()
    conn: Any = getattr(tx, "_connection", None)
    if (
        state is None
        or conn is None
        or id(getattr(conn, "_top_xact", None)) != id(tx)
        or getattr(tx, "_nested", True)
        or getattr(tx, "_state", None) is not state.STARTED
    ):
        return False
    conn._top_xact = None
    try:
        await conn.execute(statements, timeout=commit_timeout(conn))
    except BaseException:
        tx._state = state.FAILED
        raise
    tx._state = getattr(state, ended)
    return True


def forget_transaction(conn: Any) -> None:
    """Tell asyncpg that no transaction of its own is open on `conn` (one we began through
    `begin_with` and ended with a statement of ours, or that the handler ended): without, it
    would take a later `conn.transaction()` for a savepoint. Private state, as in
    _finish_with; where it is missing, there is nothing to forget."""
    if private_transaction_state() is None:
        return
    real = getattr(conn, "_con", conn)  # a pool's proxy holds its connection there
    if hasattr(real, "_top_xact"):
        real._top_xact = None


async def begin_with(
    conn: Any, statements: str, timeout: float | None = None
) -> tuple[Any, str] | None:
    """Begin a transaction on `conn` by running `statements` (a simple-query string that
    starts with BEGIN) in one round trip, keeping asyncpg's own view of it right: the result is
    an asyncpg transaction, started as if `conn.transaction().start()` had run, and the status
    of the last statement (`SELECT 1`, say).

    None, having run nothing, when this asyncpg version does not let us begin that way (the
    caller then begins the ordinary way)."""
    # Private state, set as asyncpg's own start() sets it (see the module).
    state: Any = private_transaction_state()
    tx = conn.transaction()
    real: Any = getattr(tx, "_connection", None)
    if (
        state is None
        or real is None
        or getattr(real, "_top_xact", 0) is not None
        or getattr(tx, "_state", None) is not state.NEW
        or real.is_in_transaction()
    ):
        return None
    real._top_xact = tx
    try:
        status: str = await real.execute(statements, timeout=timeout)
    except BaseException:
        tx._state = state.FAILED
        raise
    tx._state = state.STARTED
    return tx, status


async def begin(conn: Any, statements: str, isolation: str | None) -> tuple[Any, str]:
    """Begin by `statements` (a BEGIN, at `isolation`, and what comes after it in one simple
    query): asyncpg's transaction and the status of the last statement. In one round trip
    where `begin_with` can; else asyncpg begins it (a round trip) and the rest follows."""
    begun = await begin_with(conn, statements)
    if begun is not None:
        return begun
    tx = conn.transaction(isolation=None if isolation is None else isolation.replace(" ", "_"))
    await tx.start()
    status: str = await conn.execute(statements.split("; ", 1)[1])
    return tx, status


async def end(conn: Any, tx: Any, ending: Ending) -> None:
    """End asyncpg transaction `tx` on `conn` (None: asyncpg knows of none) by running
    `ending`: what comes before its verb, the verb (COMMIT or ROLLBACK; none when the
    transaction ended already), and what comes after. In one round trip where asyncpg lets
    the store end its transaction with a statement of its own, else with asyncpg's own
    COMMIT or ROLLBACK between the two (a round trip or two more). asyncpg's view is right
    afterwards either way."""
    before, verb, after = ending
    text = ending.text
    if tx is not None and verb:
        finish = commit_with if verb == "COMMIT" else rollback_with
        if await finish(tx, text):
            return
    if tx is None or private_transaction_state() is not None:
        forget_transaction(conn)
        if text:
            await conn.execute(text, timeout=commit_timeout(conn))
        return
    # This asyncpg keeps its transaction where the store cannot end it: its own calls.
    if before:
        await conn.execute(before)
    if verb == "COMMIT":
        await tx.commit()
    else:
        await tx.rollback()  # a ROLLBACK with no transaction open is only a warning
    if after:
        await conn.execute(after)
