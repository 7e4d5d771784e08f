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


def reset_unlocking(*locks: int) -> str:
    """The reset, its first statement letting `locks` go first, one after the other, and
    then every other lock of the session (a SELECT's list is evaluated in its order, as the
    executor does, though PostgreSQL does not promise it: the two unlocks shared one SELECT
    before, too): no statement of their own. Numbers (see `_keyhash`)."""
    first = "".join([f"pg_advisory_unlock({int(lock)}), " for lock in locks])
    return f"SELECT {first}pg_advisory_unlock_all(); {_AFTER_LOCKS}"


def release_locks(*locks: int) -> str:
    """`locks` let go of, in that order, in one statement (none: nothing), with no reset
    after it: an atomic request's lock after its ROLLBACK, say (see atomic.begin_locked).
    Numbers (see `_keyhash`)."""
    if not locks:
        return ""
    return "SELECT " + ", ".join([f"pg_advisory_unlock({int(lock)})" for lock in locks]) + "; "
