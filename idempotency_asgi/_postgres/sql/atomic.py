"""The atomic mode's statements (see `_postgres/atomic.py`): the claim, the handler's writes and the
record in one transaction, with one COMMIT.

The first look is PEEK (see claiming.py), on the connection the request will run on. Then
the transaction takes the request's lock and the key's (see `begin_locked`), tried and never
waited for: the locks, not a row, say that the key is in flight, so nothing else waits on a
row of it. The key's row is read again once they are held, by a statement of its own (a
statement reads the snapshot taken when it started, and one that began before an earlier
owner committed, and then took the lock that owner let go of, would not see its record).
The row is written once, last, with the stored answer.
"""

import textwrap

from .rows import NEW_ROW_COLUMNS, NEW_ROW_VALUES, found_row
from .waiting import CHANNEL, waited_for, wake_token

_WAKE_TOKEN = wake_token("$1", "$2")
_WAITED_FOR = waited_for("$1", "$2")

#: What BEGIN says for each isolation level a request's transaction may be given.
_ISOLATION = {
    None: "BEGIN",
    "read committed": "BEGIN ISOLATION LEVEL READ COMMITTED",
    "repeatable read": "BEGIN ISOLATION LEVEL REPEATABLE READ",
    "serializable": "BEGIN ISOLATION LEVEL SERIALIZABLE",
}


def begin_locked(key_lock: int, request_lock: int, isolation: str | None = None) -> str:
    """BEGIN, and the request's advisory lock then the key's, each tried, in one round trip
    (a simple query: its status says whether both were had, `SELECT 1`, or not, `SELECT 0`).

    The request's lock (its fingerprint's) is the session's: it outlasts the transaction, so
    a handler that commits or rolls back the transaction itself lets no duplicate of the
    request in, and it is let go of by the statement after the COMMIT, in the same round trip
    (see session.reset_unlocking), or by the connection's reset. The key's lock is the
    transaction's, let go of by the COMMIT or ROLLBACK itself: always before the request's,
    so that whoever finds the request's lock free (every claim and look tries it first, see
    claiming.py) finds the key's free too when it is the same request. A request's lock had
    without the key's is let go of at once. Both are numbers (see `_keyhash`), never text from
    a request; `isolation` is one of _config.ISOLATION_LEVELS."""
    return (
        f"{_ISOLATION[isolation]}; SELECT 1 WHERE CASE"
        f" WHEN pg_try_advisory_lock({int(request_lock)}) THEN CASE"
        f" WHEN pg_try_advisory_xact_lock({int(key_lock)}) THEN true"
        f" WHEN pg_advisory_unlock({int(request_lock)}) THEN false END"
        " ELSE false END"
    )


# The request's lock alone, for the session (see begin_locked): at REPEATABLE READ or
# SERIALIZABLE it is taken before the transaction begins, and the key's row read after it
# ($1: the request's lock).
LOCK_REQUEST = "SELECT pg_try_advisory_lock($1)"


def begin_key_locked(key_lock: int, isolation: str | None = None) -> str:
    """BEGIN, and the key's lock tried for the transaction, in one round trip (its status
    says whether it was had, `SELECT 1`, or not): after LOCK_REQUEST."""
    return f"{_ISOLATION[isolation]}; SELECT 1 WHERE pg_try_advisory_xact_lock({int(key_lock)})"


# begin_locked's locks, where the key table is distributed by Citus (see
# `_database.Database.distributed`): a statement of its own after BEGIN, routed to the
# worker that holds the tenant's shard ($1, $2: the tenant and the key; $3, $4: the key's
# and the request's locks, tried in begin_locked's order). Without a table a statement runs
# on the node the application is connected to, and the key's lock would live there, where
# the claims and first looks that Citus sends to the worker would never see it; through the
# key table it lives on that worker, whichever node the application connects to. What it
# reads of the table is nothing (a count, of the one key, that nobody looks at): the row is
# read by READ, as on one server.
LOCK_KEY = """
SELECT 1 FROM (
    SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
) AS routed
WHERE CASE WHEN pg_try_advisory_xact_lock($4) THEN pg_try_advisory_xact_lock($3) ELSE false END
"""

# The key's row, as it stands now that the locks are held ($3: the request's fingerprint):
# read in the request's transaction at READ COMMITTED (each statement takes its snapshot when
# it starts); at REPEATABLE READ or SERIALIZABLE after LOCK_REQUEST and before the transaction
# begins (whose snapshot its first statement takes; and at SERIALIZABLE a read inside it would
# hold a predicate lock on the primary key's index, making neighbouring keys' transactions
# fail each other).
READ = f"""
SELECT {found_row("k", "$1", "$2", "$3")}
FROM idempotency_keys AS k
WHERE k.tenant_id = $1 AND k.idempotency_key = $2
"""

# Who holds the key's row now: its token and state (none: no row). Asked when the record
# could not be written for a conflict: was the key written by another meanwhile?
KEY_ROW = """
SELECT lease_token, state FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
"""

# The tenant's stored keys, counted up to $2 (the per-tenant key bound): only for a key it
# does not hold yet, at most once a second per tenant and process (see `_postgres/keybound.py`).
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
# from the answer's time (see recording.COMPLETE). Duplicates of a replaced row that waited
# for it (`wait_seconds`) are woken.
_RECORD_INSERT = """
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
    response_status = EXCLUDED.response_status,
    response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body,
    has_waiters = false, created_at = EXCLUDED.created_at,
    completed_at = EXCLUDED.completed_at, expires_at = EXCLUDED.expires_at,
    held_reason = NULL
WHERE k.tenant_id = $1 AND k.lease_token = $12 AND k.state = $13
RETURNING expires_at
"""

RECORD = f"""
WITH written AS (
{textwrap.indent(_RECORD_INSERT.strip(), "    ")}
)
SELECT expires_at,
       CASE WHEN {_WAITED_FOR} THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END
FROM written
"""

# The record of a key that had no row: the first look found none, and the read after the lock
# none either, and every other writer of a new key tries that lock first. A plain INSERT: a
# row there after all (one committed as the lock was taken, at REPEATABLE READ) fails it with
# a unique violation, and the whole transaction rolls back. Nobody can wait for a key without
# a row: no wake-up to send.
RECORD_NEW = """
INSERT INTO idempotency_keys (
    tenant_id, idempotency_key, method, path, fingerprint, state, lease_token,
    lease_expires_at, format_version, response_status, response_headers, response_body,
    created_at, completed_at, expires_at)
VALUES ($1, $2, $3, $4, $5, 'completed', $6, statement_timestamp(), $7, $8, $9, $10,
        now(), statement_timestamp(), statement_timestamp() + make_interval(secs => $11))
RETURNING expires_at
"""

# RECORD where the key table is distributed by Citus: the INSERT alone. Citus routes no
# INSERT inside a WITH to one shard (it would run it as a step of its own, through the
# coordinator); and a NOTIFY sent there would be sent by the worker, where no listener hears
# it: waiting duplicates look at the key themselves there (see docs/scaling-out.md).
RECORD_ROUTED = _RECORD_INSERT

# A request whose handler could not tell whether its effect happened (OutcomeUnknown): its
# key is held in flight under a lease nobody renews, as in the other modes, so that no retry
# runs until the lease lapses. Written before its transaction rolls back (while that still
# holds the key's lock), in place of a replaceable row it read ($10, $11: that row's token and
# state), as the record would have been. $12: why it is held (see _records.HeldReason).
HOLD = f"""
INSERT INTO idempotency_keys AS k ({NEW_ROW_COLUMNS}, held_reason)
VALUES ({NEW_ROW_VALUES}, $12)
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
SET method = EXCLUDED.method, path = EXCLUDED.path, fingerprint = EXCLUDED.fingerprint,
    state = 'in_flight', lease_token = EXCLUDED.lease_token,
    lease_expires_at = EXCLUDED.lease_expires_at, format_version = EXCLUDED.format_version,
    response_status = NULL, response_headers = NULL, response_body = NULL,
    created_at = EXCLUDED.created_at, completed_at = NULL, expires_at = EXCLUDED.expires_at,
    held_reason = EXCLUDED.held_reason
WHERE k.tenant_id = $1 AND k.lease_token = $10 AND k.state = $11
"""
