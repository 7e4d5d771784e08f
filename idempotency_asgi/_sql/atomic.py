"""The atomic mode's statements (see `_atomic.py`): the claim, the handler's writes and the
record in one transaction, with one COMMIT.

The transaction takes the key's advisory lock first, tried and never waited for, and holds it
until it ends: the lock, not a row, says that the key is in flight, so nothing else waits on a
row of it. The key's row is read in the next statement, never in the one that takes the lock:
a statement reads the snapshot taken when it started, and one that began before an earlier
owner committed (and then took the lock that owner let go of) would not see its record. The
row is written once, last, with the stored answer.
"""

from .rows import found_row

#: What BEGIN says for each isolation level a request's transaction may be given.
_ISOLATION = {
    None: "BEGIN",
    "read committed": "BEGIN ISOLATION LEVEL READ COMMITTED",
    "repeatable read": "BEGIN ISOLATION LEVEL REPEATABLE READ",
    "serializable": "BEGIN ISOLATION LEVEL SERIALIZABLE",
}


def begin_locked(key_lock: int, request_lock: int, isolation: str | None = None) -> str:
    """BEGIN, and the key's advisory lock tried, in one round trip (a simple query: its
    status says whether the lock was had, `SELECT 1` or `SELECT 0`). Once it is had, the
    request's own lock (its fingerprint's) is taken too, waiting if need be for a look that
    holds it (shared) for one statement: it tells a duplicate from another request reusing
    the key. Both are numbers (see `_keyhash`), never text from a request; `isolation` is
    one of _config.ISOLATION_LEVELS (under REPEATABLE READ and SERIALIZABLE the snapshot is
    the transaction's, taken by this statement: a record that an owner before committed in
    between is met by the record's INSERT instead, as a conflict to retry)."""
    return (
        f"{_ISOLATION[isolation]}; SELECT 1 WHERE CASE"
        f" WHEN pg_try_advisory_xact_lock({int(key_lock)})"
        f" THEN pg_advisory_xact_lock({int(request_lock)})::text = '' ELSE false END"
    )


# The key's row, as it stands now that the lock is held ($3: the request's fingerprint).
READ = f"""
SELECT {found_row("k", "$1", "$2", "$3")}
FROM idempotency_keys AS k
WHERE k.tenant_id = $1 AND k.idempotency_key = $2
"""

# The tenant's stored keys, counted up to $2 (the per-tenant key bound): only for a key it
# does not hold yet, at most once a second per tenant and process (see `_keybound.py`).
COUNT_KEYS = """
SELECT count(*) FROM (
    SELECT 1 FROM idempotency_keys WHERE tenant_id = $1
    ORDER BY idempotency_key LIMIT $2
) AS capped
"""

# The record, written once with the answer: a new row, or in place of the row that was read
# when that one could be replaced ($12, $13: its token and state; NULL for a new key), that is
# a record past its retention or a request in flight whose owner's lease lapsed (written by a
# server in the other mode). Anything else in the way (a row that another writer put there
# meanwhile, in a rolling deploy that mixes modes) wins: nothing is returned, and the whole
# transaction rolls back. `created_at` is when the transaction began; the retention counts
# from now, the answer's time (see recording.COMPLETE).
RECORD = """
INSERT INTO idempotency_keys AS k (
    tenant_id, idempotency_key, method, path, fingerprint, state, lease_token,
    lease_expires_at, format_version, response_status, response_headers, response_body,
    created_at, completed_at, expires_at)
VALUES ($1, $2, $3, $4, $5, 'completed', $6, statement_timestamp(), $7, $8, $9, $10,
        now(), statement_timestamp(), statement_timestamp() + make_interval(secs => $11))
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
SET method = EXCLUDED.method, path = EXCLUDED.path, fingerprint = EXCLUDED.fingerprint,
    state = 'completed', lease_token = EXCLUDED.lease_token,
    lease_expires_at = EXCLUDED.lease_expires_at, format_version = EXCLUDED.format_version,
    response_status = EXCLUDED.response_status, response_headers = EXCLUDED.response_headers,
    response_body = EXCLUDED.response_body, has_waiters = false,
    created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at,
    expires_at = EXCLUDED.expires_at
WHERE k.tenant_id = $1 AND k.lease_token = $12 AND k.state = $13
RETURNING expires_at
"""

# A request whose handler could not tell whether its effect happened (OutcomeUnknown): after
# its transaction rolled back, its key is held in flight under a lease nobody renews, as in
# the other modes, so that no retry runs until the lease lapses.
HOLD = """
INSERT INTO idempotency_keys (
    tenant_id, idempotency_key, method, path, fingerprint, state,
    lease_token, lease_expires_at, format_version, expires_at)
VALUES ($1, $2, $3, $4, $5, 'in_flight', $6, now() + make_interval(secs => $7), $9,
        now() + make_interval(secs => $8))
ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
"""
