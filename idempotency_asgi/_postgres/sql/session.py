"""Sessions of connections lent to handlers (see `_postgres/lending.py`)."""

# Run on connections that were lent to an application handler before anyone else gets them
# (the store's own statements leave no session state behind): what asyncpg's pool runs on
# release by default, and what it leaves that one tenant's request must not hand the next: a
# role or session user (RESET ALL keeps both), temporary tables and sequence state. DISCARD
# ALL would also drop asyncpg's cached prepared statements, which every later query on the
# connection expects to find, so a handler's own SQL PREPARE is its own to DEALLOCATE.
# RESET ROLE even though RESET SESSION AUTHORIZATION ends a SET ROLE on today's servers:
# before 13.17, 14.14, 15.9, 16.5 and 17.1 it left the role setting in place, where a later
# SET LOCAL ROLE rolled back to a savepoint would bring the last tenant's role back.
_AFTER_LOCKS = (
    "CLOSE ALL; UNLISTEN *; RESET SESSION AUTHORIZATION; RESET ROLE; RESET ALL; DISCARD TEMP; "
    "DISCARD SEQUENCES;"
)
RESET_SESSION = "SELECT pg_advisory_unlock_all(); " + _AFTER_LOCKS


def reset_unlocking(*locks: int) -> str:
    """The reset, its first statement letting `locks` go first, one after the other, and
    then every other lock of the session (a SELECT's list is evaluated in its order, as the
    executor does, though PostgreSQL does not promise it: the two unlocks shared one SELECT
    before, too): no statement of their own. Numbers (see `_keyhash`)."""
    first = "".join([f"pg_advisory_unlock({int(lock)}), " for lock in locks])
    return f"SELECT {first}pg_advisory_unlock_all(); {_AFTER_LOCKS}"


# The COMMIT of a lent connection's transaction with the same reset after it: one round trip
# for both. COMMIT first, so it runs with the handler's settings (a `SET LOCAL
# synchronous_commit`, what deferred triggers read). If it fails the server skips the rest and
# the release resets the session as usual. What follows a COMMIT that succeeded cannot fail
# short of a cancel or a lost connection, and then the key row, committed, is the answer.
COMMIT_AND_RESET = "COMMIT; " + RESET_SESSION


def release_lock(request_lock: int) -> str:
    """What the reset of an atomic request's connection begins with: its request's lock let
    go of (see atomic.begin_locked). A number (see `_keyhash`)."""
    return f"SELECT pg_advisory_unlock({int(request_lock)}); "
