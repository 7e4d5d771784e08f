"""The claim's statements (see `_postgres/claiming.py`): reserve a key, or read what holds it.

A claim reads the key's row first and inserts only when there is none. Reading takes no
lock and waits for nobody: a replay, a 409 or a 422 never queues behind a lock another
transaction holds on the row (a transactional request's completion, uncommitted until its
COMMIT ends, updates the row: `INSERT ... ON CONFLICT DO NOTHING` on an existing key would
wait for that COMMIT, and so would every other key sharing the statement).

A new key is inserted only while its advisory lock is free, tried (shared, for this
statement only) and never waited for: an atomic-mode request holds that lock, exclusive,
from its start to its COMMIT and writes the key's row last, so a key it is running reads as
'locked' (in flight) instead of making the INSERT wait on its uncommitted row. It holds the
request's own lock too (its fingerprint's). Every statement tries the request's lock first
and holds it while it tries the key's: found held, the same request is in flight ('locked');
found free while the key's is held, another request has the key ('mismatch', as it would
once the row is there). Tried the other way round, an owner that ended between the two tries
made its own retry read as 'mismatch' (a 422 for a key that was never reused).
"""

from .rows import NEW_ROW_COLUMNS, NEW_ROW_VALUES, found_row, lease_end, no_row


def _tried(request_lock: str, key_lock: str) -> str:
    """The locks of a request and of its key tried, shared, in that order (see above): 'free'
    (both had, for this statement), 'locked' (this request is in flight) or 'mismatch'
    (another request has the key)."""
    return f"""CASE WHEN NOT pg_try_advisory_xact_lock_shared({request_lock}) THEN 'locked'
                WHEN pg_try_advisory_xact_lock_shared({key_lock}) THEN 'free'
                ELSE 'mismatch' END"""


# What a look answers for a key without a row: 'absent' when nobody has it.
_PEEKED = "CASE WHEN free.lock = 'free' THEN 'absent' ELSE free.lock END"

# One round trip for every outcome of a claim ($10: the key's advisory lock, $11: the
# request's, see `_keyhash`): "claimed" (the INSERT happened), the existing row, 'locked' or
# 'mismatch' (an atomic transaction runs this request, or another one, on the key).
# No row at all means the INSERT met a row committed after this statement's snapshot was
# taken: the caller simply runs the claim again.
CLAIM = f"""
WITH existing AS (
    SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
),
free AS (
    SELECT {_tried("$11", "$10")} AS lock
    WHERE NOT EXISTS (SELECT 1 FROM existing)
),
inserted AS (
    INSERT INTO idempotency_keys ({NEW_ROW_COLUMNS})
    SELECT {NEW_ROW_VALUES}
    WHERE (SELECT lock FROM free) = 'free'
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING ctid
)
SELECT {no_row("true", "NULL", "inserted.ctid")} FROM inserted
UNION ALL
SELECT {found_row("k", "$1", "$2", "$5")} FROM existing AS k
UNION ALL
SELECT {no_row("false", "free.lock")} FROM free WHERE free.lock <> 'free'
"""


def _busy(cap: str) -> str:
    """The tenant's keys in flight under a live lease, counted up to `cap` (a parameter)."""
    return f"""busy AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM idempotency_keys AS k
        WHERE tenant_id = $1 AND state = 'in_flight'
          AND (lease_expires_at > now() OR EXISTS (
              SELECT 1 FROM idempotency_leases AS l
              WHERE l.tenant_id = $1 AND l.idempotency_key = k.idempotency_key
                AND l.lease_token = k.lease_token AND l.lease_expires_at > now()))
        LIMIT coalesce({cap}, 0)
    ) AS capped
)"""


def _stored(bound: str) -> str:
    """The tenant's stored keys, counted up to `bound` (a parameter)."""
    return f"""stored AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM idempotency_keys WHERE tenant_id = $1
        ORDER BY idempotency_key LIMIT {bound}
    ) AS capped
)"""


_BUSY = _busy("$12")

# The claim with a per-tenant cap on keys in flight ($12): a new key is inserted only while
# the tenant has fewer in flight, and "over_limit" says so when it has not. Only live leases
# count: a key whose owner died is not in flight, whether or not anyone has retried or swept
# it yet. The count is not serialised against concurrent claims, so a burst may overshoot the
# cap by a few: it bounds abuse, it is not a quota.
CLAIM_CAPPED = f"""
WITH existing AS (
    SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
),
{_BUSY},
free AS (
    SELECT {_tried("$11", "$10")} AS lock
    WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT n FROM busy) < $12
),
inserted AS (
    INSERT INTO idempotency_keys ({NEW_ROW_COLUMNS})
    SELECT {NEW_ROW_VALUES}
    WHERE (SELECT lock FROM free) = 'free'
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING ctid
)
SELECT {no_row("true", "NULL", "inserted.ctid")} FROM inserted
UNION ALL
SELECT {found_row("k", "$1", "$2", "$5")} FROM existing AS k
UNION ALL
SELECT {no_row("false", "free.lock")} FROM free WHERE free.lock <> 'free'
UNION ALL
SELECT {no_row("false", "'over_limit'")}
WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT n FROM busy) >= $12
"""

# The claim with a per-tenant bound on stored keys ($13: rows of the tenant, in flight or
# completed, expired ones the reaper has not reached yet included), and the in-flight cap of
# CLAIM_CAPPED as well when $12 is not NULL. Only a key the tenant does not hold yet is
# counted against it (CASE evaluates in order): a replay or a conflict costs what CLAIM does,
# a new key a walk of the tenant's primary-key entries, up to $13. The ORDER BY is the
# index's own order, and keeps the walk on it: without, the generic plan of the prepared
# statement read the whole table (23 ms a claim on 400,000 rows, whatever the tenant held).
# As for CLAIM_CAPPED, the counts are not serialised against concurrent claims: a burst may
# overshoot by a few; it bounds abuse, it is not a quota.
CLAIM_BOUNDED = f"""
WITH existing AS (
    SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
),
{_BUSY},
{_stored("$13")},
refused AS (
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM existing) THEN NULL
        WHEN (SELECT n FROM stored) >= $13 THEN 'over_quota'
        WHEN $12 IS NOT NULL AND (SELECT n FROM busy) >= $12 THEN 'over_limit'
    END AS state
),
free AS (
    SELECT {_tried("$11", "$10")} AS lock
    WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT state FROM refused) IS NULL
),
inserted AS (
    INSERT INTO idempotency_keys ({NEW_ROW_COLUMNS})
    SELECT {NEW_ROW_VALUES}
    WHERE (SELECT lock FROM free) = 'free'
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING ctid
)
SELECT {no_row("true", "NULL", "inserted.ctid")} FROM inserted
UNION ALL
SELECT {found_row("k", "$1", "$2", "$5")} FROM existing AS k
UNION ALL
SELECT {no_row("false", "free.lock")} FROM free WHERE free.lock <> 'free'
UNION ALL
SELECT {no_row("false", "refused.state")} FROM refused WHERE refused.state IS NOT NULL
"""

# Compare-and-set on the token that was read: of several concurrent takers, exactly one wins;
# the others claim again and find the winner's live lease. Only finished rows past retention,
# or rows in flight under a lapsed lease for the same request, can be taken; a live request is
# never taken, however long it runs, as long as its heartbeat renews the lease. A row locked
# by another transaction (a completion whose COMMIT is under way) is skipped, never waited
# for: it is about to change. A key whose advisory lock an atomic transaction holds ($11) is
# not taken either: that transaction is replacing the row. The answer: whether the lock was
# free, and whether the row was taken. The request's own lock ($12) is tried first, as by
# every claim (see above).
TAKE_OVER = f"""
WITH free AS (
    SELECT CASE WHEN pg_try_advisory_xact_lock_shared($12)
                THEN pg_try_advisory_xact_lock_shared($11) ELSE false END AS held
),
target AS (
    SELECT 1 FROM idempotency_keys AS k
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $10
      AND ((state = 'completed' AND expires_at <= now())
           OR (state = 'in_flight' AND fingerprint = $5
               AND {lease_end("k", "$1", "$2")} <= now()))
      AND (SELECT held FROM free)
    FOR UPDATE SKIP LOCKED
),
taken AS (
    UPDATE idempotency_keys
    SET method = $3, path = $4, fingerprint = $5, state = 'in_flight',
        lease_token = $6, lease_expires_at = now() + make_interval(secs => $7),
        format_version = $9, expires_at = now() + make_interval(secs => $8),
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = now(), completed_at = NULL, held_reason = NULL
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $10
      AND EXISTS (SELECT 1 FROM target)
    RETURNING ctid
)
SELECT (SELECT held FROM free) AS free, EXISTS (SELECT 1 FROM taken) AS taken,
       (SELECT ctid FROM taken) AS row_id
"""

# What holds a key, without claiming it ($3: the request's fingerprint, $4: the key's advisory
# lock, $5: the request's): the row; 'locked' or 'mismatch' while an atomic transaction runs
# this request or another one on the key; 'absent' when nobody does.
# The atomic mode's first statement (a replay, a 409 or a 422 costs it alone) and a waiter's
# look. Trying the lock takes it for this statement only.
PEEK = f"""
WITH existing AS (
    SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
),
free AS (
    SELECT {_tried("$5", "$4")} AS lock
    WHERE NOT EXISTS (SELECT 1 FROM existing)
)
SELECT {found_row("k", "$1", "$2", "$3")} FROM existing AS k
UNION ALL
SELECT {no_row("false", _PEEKED)} FROM free
"""

# -- the claim on Citus: a look, then the INSERT ------------------------------------------
# Citus routes a statement to the one shard of its tenant only when it can send the whole
# statement there, and it never does so for an INSERT inside a WITH: it runs CLAIM's CTEs one
# by one from the coordinator, over both workers, with a two-phase commit. Where the key
# table is distributed (see `_database.Database.distributed`) a claim is therefore two
# statements, each routed whole to the tenant's shard: PEEK (or LOOK_CAPPED, LOOK_BOUNDED
# with the tenant's limits), which answers as the claim would except that 'absent' stands for
# "nobody has it: insert it"; then INSERT_KEY. The key's advisory lock is tried on the worker
# that holds the tenant's shard, where the atomic mode takes it too (atomic.LOCK_KEY). A
# replay, a 409 or a 422 costs the look alone. An atomic transaction that takes the key
# between the two statements meets the inserted row at its record and rolls back (see
# atomic.RECORD): one of the two runs, never both.

# A new key's row, as CLAIM would insert it ($1-$9 as CLAIM's); 1, or no row when the key
# was taken meanwhile (the caller looks again).
INSERT_KEY = f"""
INSERT INTO idempotency_keys ({NEW_ROW_COLUMNS})
VALUES ({NEW_ROW_VALUES})
ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
RETURNING 1
"""

# PEEK with CLAIM_CAPPED's cap on keys in flight ($6): 'over_limit' when the tenant has that
# many. $1-$5 as PEEK's.
LOOK_CAPPED = f"""
WITH existing AS (
    SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
),
{_busy("$6")},
free AS (
    SELECT {_tried("$5", "$4")} AS lock
    WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT n FROM busy) < $6
)
SELECT {found_row("k", "$1", "$2", "$3")} FROM existing AS k
UNION ALL
SELECT {no_row("false", _PEEKED)} FROM free
UNION ALL
SELECT {no_row("false", "'over_limit'")}
WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT n FROM busy) >= $6
"""

# PEEK with CLAIM_BOUNDED's bound on stored keys ($7), and the cap on keys in flight ($6)
# when it is not NULL. $1-$5 as PEEK's.
LOOK_BOUNDED = f"""
WITH existing AS (
    SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
),
{_busy("$6")},
{_stored("$7")},
refused AS (
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM existing) THEN NULL
        WHEN (SELECT n FROM stored) >= $7 THEN 'over_quota'
        WHEN $6::int8 IS NOT NULL AND (SELECT n FROM busy) >= $6 THEN 'over_limit'
    END AS state
),
free AS (
    SELECT {_tried("$5", "$4")} AS lock
    WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT state FROM refused) IS NULL
)
SELECT {found_row("k", "$1", "$2", "$3")} FROM existing AS k
UNION ALL
SELECT {no_row("false", _PEEKED)} FROM free
UNION ALL
SELECT {no_row("false", "refused.state")} FROM refused WHERE refused.state IS NOT NULL
"""

# -- batched: many requests' claims in one statement (see _postgres/batching.py) -------------------
# The one-row statements above, for the rows of arrays: `unnest(...) WITH ORDINALITY` numbers
# them (n), and the answer has one row per n with what the one-row statement answers (none for
# a row to claim again). A batch never holds the same key twice (the batcher sees to it). The
# key table is looked up per row through a LATERAL subquery with LIMIT 1, which the planner
# cannot turn into a join: whatever it guesses of the arrays' length, or of the table from
# statistics a busy table outgrew, every row is a probe of the primary key, never a scan of
# the table. Rows are inserted in key order, so two batches that meet on the same keys wait
# for each other in one order, never in a circle.

_FOUND = f"""existing AS (
    SELECT i.n, found.*
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT * FROM idempotency_keys AS k
        WHERE k.tenant_id = i.tenant_id AND k.idempotency_key = i.idempotency_key
        LIMIT 1
    ) AS found
),
free AS (
    SELECT i.n, {_tried("i.request_lock", "i.lock_id")} AS lock
    FROM input AS i
    WHERE NOT EXISTS (SELECT 1 FROM existing AS e WHERE e.n = i.n)
)"""
_FOUND_ROW = found_row("e", "e.tenant_id", "e.idempotency_key", "i.fingerprint")
_PEEKED_ROW = "CASE WHEN f.lock = 'free' THEN 'absent' ELSE f.lock END"

CLAIM_MANY = f"""
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                         $6::int8[], $7::float8[], $8::float8[], $9::int8[], $10::int8[])
        WITH ORDINALITY AS i(tenant_id, idempotency_key, method, path, fingerprint,
                             lease_token, lease_seconds, ttl_seconds, lock_id, request_lock, n)
),
{_FOUND},
inserted AS (
    INSERT INTO idempotency_keys ({NEW_ROW_COLUMNS})
    SELECT i.tenant_id, i.idempotency_key, i.method, i.path, i.fingerprint, 'in_flight',
           i.lease_token, now() + make_interval(secs => i.lease_seconds), $11,
           now() + make_interval(secs => i.ttl_seconds)
    FROM input AS i
    JOIN free AS f ON f.n = i.n AND f.lock = 'free'
    ORDER BY i.tenant_id, i.idempotency_key
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING tenant_id, idempotency_key, lease_token, ctid
)
SELECT i.n, {no_row("true", "NULL", "ins.ctid")}
FROM input AS i
JOIN inserted AS ins
  ON ins.tenant_id = i.tenant_id AND ins.idempotency_key = i.idempotency_key
 AND ins.lease_token = i.lease_token
UNION ALL
SELECT e.n, {_FOUND_ROW}
FROM existing AS e JOIN input AS i ON i.n = e.n
UNION ALL
SELECT f.n, {no_row("false", "f.lock")} FROM free AS f WHERE f.lock <> 'free'
ORDER BY n
"""

PEEK_MANY = f"""
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::int8[])
        WITH ORDINALITY AS i(tenant_id, idempotency_key, fingerprint, lock_id, request_lock, n)
),
{_FOUND}
SELECT e.n, {_FOUND_ROW}
FROM existing AS e JOIN input AS i ON i.n = e.n
UNION ALL
SELECT f.n, {no_row("false", _PEEKED_ROW)}
FROM free AS f
ORDER BY n
"""
