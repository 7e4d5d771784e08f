"""What waiting duplicates share with the requests they wait for (see `_postgres/waiting.py`).

A duplicate that waits (`wait_seconds`) marks the key in `idempotency_leases`; a completion
or a release of a marked key NOTIFYs on CHANNEL, with a payload naming the key (see
`_keyhash.wake_token`, which computes the same value in Python). NOTIFY takes a lock at
COMMIT that every notifying transaction queues for, so it is only evaluated for keys somebody
waits for.
"""

CHANNEL = "idempotency_asgi"


def wake_token(tenant: str, key: str) -> str:
    """The payload of a wake-up for the key of `tenant` and `key` (SQL expressions)."""
    return (
        f"left(encode(sha256(convert_to(length({tenant})::text || ':' || {tenant} || {key},"
        " 'UTF8')), 'hex'), 32)"
    )


def waited_for(tenant: str, key: str, *, per_row: bool = False) -> str:
    """Whether a duplicate waits for this key (see MARK_WAITING). The key row's own flag is
    what versions before the lease table set. `per_row`: for a statement about many rows
    (a batch's), the lease table read by its key for each of them, never hashed whole: a
    generic plan made while the lease table was small would otherwise read all of it on
    every run once it had grown (OFFSET 0 keeps PostgreSQL from turning the EXISTS into a
    hashed subplan)."""
    offset = " OFFSET 0" if per_row else ""
    return f"""EXISTS (
    SELECT 1 FROM idempotency_leases AS l
    WHERE l.tenant_id = {tenant} AND l.idempotency_key = {key} AND l.has_waiters{offset})"""


# A duplicate about to wait says so, in the lease table; no row marked means the request
# finished meanwhile, is finishing (a completion or release under way holds the key row: its
# outcome is moments away), or is an atomic transaction's (no row until it commits). SHARE
# SKIP LOCKED: a row a completion holds is not marked (that completion may have decided not to
# NOTIFY already), and not waited for either: the waiter's wait is its own, never a statement
# connection held behind one key's slow COMMIT. A share lock changes no row version, so it
# never fails a handler's REPEATABLE READ snapshot.
# It writes the key row's own tenant and key (equal to $1, $2), for Citus's sake (see
# recording.RENEW).
MARK_WAITING = """
INSERT INTO idempotency_leases
    (tenant_id, idempotency_key, lease_token, lease_expires_at, has_waiters)
SELECT tenant_id, idempotency_key, lease_token, lease_expires_at, true
FROM idempotency_keys
WHERE tenant_id = $1 AND idempotency_key = $2 AND completed_at IS NULL
FOR SHARE SKIP LOCKED
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE SET has_waiters = true
"""

# Whether the key's advisory lock is free ($3, see `_keyhash.key_lock`; $1, $2: the tenant
# and the key), for a waiter of the request whose own lock is $4 (NULL: an operator's look):
# an atomic-mode request holds both until it ends. Tried (shared) in the order every claim
# tries them (see claiming.py), and let go of at once. It goes through the key table
# (reading nothing of it) so that, on Citus, it runs where the lock lives: on the worker that
# holds the tenant's shard (see atomic.LOCK_KEY).
LOCK_FREE = """
SELECT CASE WHEN $4::int8 IS NOT NULL AND NOT pg_try_advisory_xact_lock_shared($4) THEN false
            ELSE pg_try_advisory_xact_lock_shared($3) END FROM (
    SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
) AS routed
"""

# Whether a session or a transaction holds the key's advisory lock ($1), read from pg_locks
# and never tried: a try holds the lock for as long as its statement runs, and an atomic
# request that tried it in that moment would be told the key is someone else's. For
# operators (`inspect`), on one server.
KEY_LOCKED = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND ((classid::int8 << 32) | objid::int8) = $1
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
"""
