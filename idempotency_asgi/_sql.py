"""The store's statements. Every one filters by tenant_id first (distributable by tenant: see
docs/scaling-out.md), and every one that changes a claimed row is fenced by the lease token
(docs/how-it-works.md; what each outcome answers is docs/contract.md).

Renewals and waiters' marks go to a table of their own, `idempotency_leases`, never to the key
row: in transactional mode the key row is completed inside the handler's transaction, and
under REPEATABLE READ or SERIALIZABLE PostgreSQL refuses to update a row that another
transaction changed after the handler's snapshot was taken. A heartbeat that renewed the key
row itself failed every such handler that ran longer than a third of its lease. Only a
takeover or a sweep changes an in-flight key row now, and for those the refusal is right. A
key's lease lasts until the later of its row's `lease_expires_at` (set by the claim) and the
renewal of the same token, if any (`_LEASE_END`).

A statement about one key's in-flight row says so with `completed_at IS NULL`, never with
`state = 'in_flight'`: the latter lets the planner pick the small in-flight index, which has
only tenant_id in front of the key, and walk every in-flight entry of the tenant (dead ones
too, until vacuum) instead of probing the primary key. The schema keeps the two equivalent
(a CHECK constraint): a row is completed exactly when it has a completion time.
"""

# The parts both claims share. The new row, as the INSERT's column list and its values:
_NEW_ROW_COLUMNS = """
        tenant_id, idempotency_key, method, path, fingerprint, state,
        lease_token, lease_expires_at, format_version, expires_at"""
_NEW_ROW_VALUES = """
        $1, $2, $3, $4, $5, 'in_flight',
        $6, now() + make_interval(secs => $7), $9, now() + make_interval(secs => $8)"""
# What a claim returns: "claimed" (the INSERT happened), or the existing row, with its stored
# response only when the fingerprints match (a mismatch need not carry a body over the wire).
_CLAIMED = """
SELECT true AS claimed, NULL::text AS state, NULL::boolean AS same_request,
       NULL::bigint AS lease_token, NULL::float8 AS lease_remaining, NULL::boolean AS expired,
       NULL::smallint AS format_version, NULL::smallint AS response_status,
       NULL::bytea AS response_headers, NULL::bytea AS response_body,
       NULL::timestamptz AS expires_at, NULL::float8 AS running_for
FROM inserted"""
# When the lease of in-flight row `k` (of tenant $1, key $2) ends: its claim's, or a renewal's.
_LEASE_END = """greatest(k.lease_expires_at, (
    SELECT l.lease_expires_at FROM idempotency_leases AS l
    WHERE l.tenant_id = $1 AND l.idempotency_key = $2 AND l.lease_token = k.lease_token))"""
_EXISTING = f"""
SELECT false, k.state, k.fingerprint = $5,
       k.lease_token,
       CASE WHEN k.state = 'in_flight'
            THEN extract(epoch FROM {_LEASE_END} - now())::float8 END,
       k.expires_at <= now(),
       k.format_version, k.response_status,
       CASE WHEN k.fingerprint = $5 THEN k.response_headers END,
       CASE WHEN k.fingerprint = $5 THEN k.response_body END,
       k.expires_at, extract(epoch FROM now() - k.created_at)::float8
FROM idempotency_keys AS k
WHERE k.tenant_id = $1 AND k.idempotency_key = $2
  AND NOT EXISTS (SELECT 1 FROM inserted)"""

# One round trip for every outcome of a claim. The INSERT either reserves the key or, on a
# conflict, does nothing: DO NOTHING takes no row lock, so a storm of retries on one hot key
# never queues behind itself. The second branch then reads the existing row; it runs only when
# the INSERT did not. It may find no row at all when the conflicting row was committed after
# this statement's snapshot was taken: the caller simply runs the claim again.
CLAIM = f"""
WITH inserted AS (
    INSERT INTO idempotency_keys ({_NEW_ROW_COLUMNS})
    VALUES ({_NEW_ROW_VALUES})
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING 1
)
{_CLAIMED}
UNION ALL
{_EXISTING}
"""

# The claim with a per-tenant cap on keys in flight ($10): the same, but the INSERT happens
# only while the tenant has fewer in flight, and a third branch says "over the limit" when
# neither a row was inserted nor one exists. Only live leases count: a key whose owner died
# is not in flight, whether or not anyone has retried or swept it yet. The count is not
# serialised against concurrent claims, so a burst may overshoot the cap by a few: it bounds
# abuse, it is not a quota.
CLAIM_CAPPED = f"""
WITH busy AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM idempotency_keys AS k
        WHERE tenant_id = $1 AND state = 'in_flight'
          AND (lease_expires_at > now() OR EXISTS (
              SELECT 1 FROM idempotency_leases AS l
              WHERE l.tenant_id = $1 AND l.idempotency_key = k.idempotency_key
                AND l.lease_token = k.lease_token AND l.lease_expires_at > now()))
        LIMIT $10
    ) AS capped
),
inserted AS (
    INSERT INTO idempotency_keys ({_NEW_ROW_COLUMNS})
    SELECT {_NEW_ROW_VALUES}
    WHERE (SELECT n FROM busy) < $10
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING 1
),
existing AS ({_EXISTING}
)
{_CLAIMED}
UNION ALL
SELECT * FROM existing
UNION ALL
SELECT false, 'over_limit', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM existing)
  AND (SELECT n FROM busy) >= $10
"""

# Compare-and-set on the token that was read: of several concurrent takers, exactly one wins;
# the others claim again and find the winner's live lease. Only finished rows past retention,
# or rows in flight under a lapsed lease for the same request, can be taken; a live request is
# never taken, however long it runs, as long as its heartbeat renews the lease.
TAKE_OVER = f"""
UPDATE idempotency_keys AS k
SET method = $3, path = $4, fingerprint = $5, state = 'in_flight',
    lease_token = $6, lease_expires_at = now() + make_interval(secs => $7),
    format_version = $9, expires_at = now() + make_interval(secs => $8),
    response_status = NULL, response_headers = NULL, response_body = NULL,
    created_at = now(), completed_at = NULL
WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $10
  AND ((state = 'completed' AND expires_at <= now())
       OR (state = 'in_flight' AND fingerprint = $5 AND {_LEASE_END} <= now()))
"""

# A renewal writes the lease table only (see the top of this module), and only while the key
# row is still in flight under this token: otherwise it writes nothing and says the lease is
# lost. A row of an earlier token (a takeover's predecessor) is overwritten; its waiters stay.
RENEW = """
INSERT INTO idempotency_leases (tenant_id, idempotency_key, lease_token, lease_expires_at)
SELECT $1, $2, $3, now() + make_interval(secs => $4)
FROM idempotency_keys
WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
SET lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at
"""

#: Waiting duplicates LISTEN here; the payload names the key (see `_store.wake_token`, which
#: computes the same value in Python). Computed here only when somebody waits.
CHANNEL = "idempotency_asgi"


def _wake_token(tenant: str, key: str) -> str:
    return (
        f"left(encode(sha256(convert_to(length({tenant})::text || ':' || {tenant} || {key},"
        " 'UTF8')), 'hex'), 32)"
    )


def _waited_for(tenant: str, key: str) -> str:
    """Whether a duplicate waits for this key (see MARK_WAITING). The key row's own flag is
    what versions before the lease table set."""
    return f"""EXISTS (
    SELECT 1 FROM idempotency_leases AS l
    WHERE l.tenant_id = {tenant} AND l.idempotency_key = {key} AND l.has_waiters)"""


_WAKE_TOKEN = _wake_token("$1", "$2")
_WAITED_FOR = _waited_for("$1", "$2")

# Completion and release wake waiting duplicates, if there are any: NOTIFY is only evaluated
# for such keys (a CASE/WHERE on the mark), so nobody else pays for it. Inside the request's
# transaction the notification goes out on commit, not before. Completion leaves the lease
# row alone (deleting it could meet a renewal made after the handler's snapshot): the
# sweeper forgets lease rows once they are long past (FORGET_LEASES). Its times are the
# clock's, not now(): inside the handler's transaction now() is when that transaction began,
# and retention counts from when the answer was recorded (a handler that spent longer than
# the retention in its transaction would otherwise commit a record already expired).
COMPLETE = f"""
WITH done AS (
    UPDATE idempotency_keys
    SET state = 'completed', format_version = $4, response_status = $5,
        response_headers = $6, response_body = $7,
        completed_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => $8)
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
    RETURNING expires_at, has_waiters
)
SELECT expires_at,
       CASE WHEN has_waiters OR {_WAITED_FOR} THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END
FROM done
"""

RELEASE = f"""
WITH gone AS (
    DELETE FROM idempotency_keys
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
    RETURNING has_waiters
),
lease AS (
    DELETE FROM idempotency_leases
    WHERE tenant_id = $1 AND idempotency_key = $2 AND EXISTS (SELECT 1 FROM gone)
    RETURNING has_waiters
)
SELECT pg_notify('{CHANNEL}', {_WAKE_TOKEN}) FROM gone
WHERE gone.has_waiters OR EXISTS (SELECT 1 FROM lease WHERE lease.has_waiters)
"""

# A duplicate about to wait says so, in the lease table; no row means the request finished
# meanwhile. FOR SHARE: a completion or release under way holds the key row, so the mark
# waits for it to commit and then finds the row finished (or gone) and marks nothing, rather
# than mark a key whose completion has already decided not to NOTIFY. A share lock changes
# no row version, so it never fails a handler's REPEATABLE READ snapshot.
MARK_WAITING = """
INSERT INTO idempotency_leases
    (tenant_id, idempotency_key, lease_token, lease_expires_at, has_waiters)
SELECT $1, $2, lease_token, lease_expires_at, true
FROM idempotency_keys
WHERE tenant_id = $1 AND idempotency_key = $2 AND completed_at IS NULL
FOR SHARE
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE SET has_waiters = true
"""

# Run on connections that were lent to an application handler before anyone else gets them
# (the store's own statements leave no session state behind): what asyncpg's pool runs on
# release by default, and what it leaves that one tenant's request must not hand the next: a
# role or session user (RESET ALL keeps both), temporary tables and sequence state. DISCARD
# ALL would also drop asyncpg's cached prepared statements, which every later query on the
# connection expects to find, so a handler's own SQL PREPARE is its own to DEALLOCATE.
RESET_SESSION = (
    "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET SESSION AUTHORIZATION; "
    "RESET ROLE; RESET ALL; DISCARD TEMP; DISCARD SEQUENCES;"
)

# The COMMIT of a lent connection's transaction with the same reset after it: one round trip
# for both. COMMIT first, so it runs with the handler's settings (a `SET LOCAL
# synchronous_commit`, what deferred triggers read). If it fails the server skips the rest and
# the release resets the session as usual. What follows a COMMIT that succeeded cannot fail
# short of a cancel or a lost connection, and then the key row, committed, is the answer.
COMMIT_AND_RESET = "COMMIT; " + RESET_SESSION

# -- batched: many requests' statements in one (see _batching.py) ---------------------------
# Each is the one-row statement above, for the rows of arrays: `unnest(...) WITH ORDINALITY`
# numbers them (n), and the answer has one row per n, in order, with what the one-row
# statement answers. A batch never holds the same key twice (the batcher sees to it). They
# span tenants, so they run only with batching on (`PostgresStore(batch=True)`, the default).
# The key table is looked up per row through a LATERAL subquery with LIMIT 1, which the
# planner cannot turn into a join: whatever it guesses of the arrays' length, or of the table
# from statistics a busy table outgrew, every row is a probe of the primary key, never a scan
# of the table. An UPDATE or DELETE then reaches the rows it found by their ctids, as a TID
# scan (`ctid = ANY (ARRAY(...))`); joined to them by ctid alone, it was planned as a hash join
# over a scan of the whole table, and the bench's completions slowed as the table grew. (A row
# changed by another transaction meanwhile has a new ctid and is left alone: only a takeover
# or a sweep changes a claimed row, and then this lease has lost it.) Rows are inserted in key
# order, so two batches that meet on the same keys wait for each other in one order, never in
# a circle.

_INPUT_CLAIMS = """
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                         $6::int8[], $7::float8[], $8::float8[])
        WITH ORDINALITY AS i(tenant_id, idempotency_key, method, path, fingerprint,
                             lease_token, lease_seconds, ttl_seconds, n)"""

CLAIM_MANY = f"""
WITH input AS ({_INPUT_CLAIMS}
),
inserted AS (
    INSERT INTO idempotency_keys ({_NEW_ROW_COLUMNS})
    SELECT tenant_id, idempotency_key, method, path, fingerprint, 'in_flight',
           lease_token, now() + make_interval(secs => lease_seconds), $9,
           now() + make_interval(secs => ttl_seconds)
    FROM input
    ORDER BY tenant_id, idempotency_key
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING tenant_id, idempotency_key, lease_token
)
SELECT i.n, ins.lease_token IS NOT NULL AS claimed, k.state,
       k.fingerprint = i.fingerprint AS same_request, k.lease_token,
       CASE WHEN k.state = 'in_flight'
            THEN extract(epoch FROM greatest(k.lease_expires_at, (
                SELECT l.lease_expires_at FROM idempotency_leases AS l
                WHERE l.tenant_id = i.tenant_id AND l.idempotency_key = i.idempotency_key
                  AND l.lease_token = k.lease_token)) - now())::float8 END AS lease_remaining,
       k.expires_at <= now() AS expired,
       k.format_version, k.response_status,
       CASE WHEN k.fingerprint = i.fingerprint THEN k.response_headers END AS response_headers,
       CASE WHEN k.fingerprint = i.fingerprint THEN k.response_body END AS response_body,
       k.expires_at, extract(epoch FROM now() - k.created_at)::float8 AS running_for
FROM input AS i
LEFT JOIN inserted AS ins
       ON ins.tenant_id = i.tenant_id AND ins.idempotency_key = i.idempotency_key
      AND ins.lease_token = i.lease_token
LEFT JOIN LATERAL (
    SELECT * FROM idempotency_keys AS found
    WHERE found.tenant_id = i.tenant_id AND found.idempotency_key = i.idempotency_key
    LIMIT 1
) AS k ON ins.lease_token IS NULL
ORDER BY i.n
"""

# The input's rows whose key is still in flight under their lease token (`target`: each
# found by a probe of the primary key), and the condition that reaches each by its ctid.
_HELD = """target AS (
    SELECT i.*, k.ctid AS row_id
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT found.ctid FROM idempotency_keys AS found
        WHERE found.tenant_id = i.tenant_id AND found.idempotency_key = i.idempotency_key
          AND found.lease_token = i.lease_token AND found.completed_at IS NULL
        LIMIT 1
    ) AS k
),"""
_HELD_ROW = """k.ctid = ANY (ARRAY(SELECT row_id FROM target)) AND k.ctid = t.row_id
      AND k.tenant_id = t.tenant_id AND k.idempotency_key = t.idempotency_key
      AND k.lease_token = t.lease_token AND k.completed_at IS NULL"""

COMPLETE_MANY = f"""
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int2[], $5::bytea[],
                         $6::bytea[], $7::float8[])
        WITH ORDINALITY AS i(tenant_id, idempotency_key, lease_token, response_status,
                             response_headers, response_body, ttl_seconds, n)
),
{_HELD}
done AS (
    UPDATE idempotency_keys AS k
    SET state = 'completed', format_version = $8, response_status = t.response_status,
        response_headers = t.response_headers, response_body = t.response_body,
        completed_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => t.ttl_seconds)
    FROM target AS t
    WHERE {_HELD_ROW}
    RETURNING t.n, k.tenant_id, k.idempotency_key, k.expires_at, k.has_waiters
)
SELECT i.n, d.expires_at,
       CASE WHEN d.has_waiters OR {_waited_for("d.tenant_id", "d.idempotency_key")}
            THEN pg_notify('{CHANNEL}', {_wake_token("d.tenant_id", "d.idempotency_key")}) END
FROM input AS i
LEFT JOIN done AS d ON d.n = i.n
ORDER BY i.n
"""

RELEASE_MANY = f"""
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])
        AS i(tenant_id, idempotency_key, lease_token)
),
{_HELD}
gone AS (
    DELETE FROM idempotency_keys AS k
    USING target AS t
    WHERE {_HELD_ROW}
    RETURNING k.tenant_id, k.idempotency_key, k.has_waiters
),
lease AS (
    DELETE FROM idempotency_leases AS l
    USING gone AS g
    WHERE l.tenant_id = g.tenant_id AND l.idempotency_key = g.idempotency_key
    RETURNING l.tenant_id, l.idempotency_key, l.has_waiters
)
SELECT pg_notify('{CHANNEL}', {_wake_token("g.tenant_id", "g.idempotency_key")}) FROM gone AS g
WHERE g.has_waiters OR EXISTS (
    SELECT 1 FROM lease
    WHERE lease.tenant_id = g.tenant_id AND lease.idempotency_key = g.idempotency_key
      AND lease.has_waiters)
"""

RENEW_MANY = """
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[])
        WITH ORDINALITY AS i(tenant_id, idempotency_key, lease_token, lease_seconds, n)
),
renewed AS (
    INSERT INTO idempotency_leases (tenant_id, idempotency_key, lease_token, lease_expires_at)
    SELECT i.tenant_id, i.idempotency_key, i.lease_token,
           now() + make_interval(secs => i.lease_seconds)
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT 1 FROM idempotency_keys AS found
        WHERE found.tenant_id = i.tenant_id AND found.idempotency_key = i.idempotency_key
          AND found.lease_token = i.lease_token AND found.completed_at IS NULL
        LIMIT 1
    ) AS held
    ORDER BY i.tenant_id, i.idempotency_key
    ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
    SET lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at
    RETURNING tenant_id, idempotency_key, lease_token
)
SELECT i.n, r.lease_token IS NOT NULL AS renewed
FROM input AS i
LEFT JOIN renewed AS r
       ON r.tenant_id = i.tenant_id AND r.idempotency_key = i.idempotency_key
      AND r.lease_token = i.lease_token
ORDER BY i.n
"""

# -- maintenance ---------------------------------------------------------------------------
# Both take one bounded batch, skip rows another runner holds, and re-check their condition
# on the row they delete, so that a row taken over or completed meanwhile is left alone.

REAP = """
WITH doomed AS (
    SELECT tenant_id, idempotency_key FROM idempotency_keys
    WHERE state = 'completed' AND expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys AS k
USING doomed AS d
WHERE k.tenant_id = d.tenant_id AND k.idempotency_key = d.idempotency_key
  AND k.state = 'completed' AND k.expires_at <= now()
"""

# The sweeper: in-flight keys whose lease (their claim's, or a renewal's: both must be long
# past) lapsed more than $2 seconds ago, with their lease rows.
SWEEP = """
WITH stale AS (
    SELECT k.tenant_id, k.idempotency_key,
           greatest(k.lease_expires_at, l.lease_expires_at) AS lease_end
    FROM idempotency_keys AS k
    LEFT JOIN idempotency_leases AS l
           ON l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
          AND l.lease_token = k.lease_token
    WHERE k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
      AND (l.lease_expires_at IS NULL OR l.lease_expires_at <= now() - make_interval(secs => $2))
    ORDER BY k.lease_expires_at
    LIMIT $1
    FOR UPDATE OF k SKIP LOCKED
),
swept AS (
    DELETE FROM idempotency_keys AS k
    USING stale AS s
    WHERE k.tenant_id = s.tenant_id AND k.idempotency_key = s.idempotency_key
      AND k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
    RETURNING k.tenant_id, k.idempotency_key, k.method, k.path, s.lease_end
),
forgotten AS (
    DELETE FROM idempotency_leases AS l
    USING swept AS s
    WHERE l.tenant_id = s.tenant_id AND l.idempotency_key = s.idempotency_key
)
SELECT tenant_id, idempotency_key, method, path,
       extract(epoch FROM now() - lease_end)::float8 AS lapsed_seconds
FROM swept
"""

# The sweeper's other half: lease rows long past their end, whatever became of their key
# (completed, released, swept, taken over). A completion leaves its lease row behind.
FORGET_LEASES = """
WITH old AS (
    SELECT tenant_id, idempotency_key FROM idempotency_leases
    WHERE lease_expires_at <= now() - make_interval(secs => $2)
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_leases AS l
USING old AS o
WHERE l.tenant_id = o.tenant_id AND l.idempotency_key = o.idempotency_key
  AND l.lease_expires_at <= now() - make_interval(secs => $2)
"""

REAP_PROCESSED = """
WITH doomed AS (
    SELECT consumer, message_id FROM idempotency_processed_messages
    WHERE processed_at <= now() - make_interval(secs => $2)
    ORDER BY processed_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_processed_messages AS m
USING doomed AS d
WHERE m.consumer = d.consumer AND m.message_id = d.message_id
"""

INSPECT = f"""
SELECT tenant_id, idempotency_key, method, path, encode(fingerprint, 'hex') AS fingerprint,
       state, lease_token, {_LEASE_END} AS lease_expires_at,
       state = 'in_flight' AND {_LEASE_END} > now() AS lease_live,
       format_version, response_status, octet_length(response_body) AS response_bytes,
       created_at, completed_at, expires_at
FROM idempotency_keys AS k
WHERE tenant_id = $1 AND idempotency_key = $2
"""

STATS = """
SELECT
    count(*) FILTER (WHERE state = 'completed') AS completed,
    count(*) FILTER (WHERE state = 'in_flight') AS in_flight,
    count(*) FILTER (WHERE state = 'in_flight' AND lease_expires_at <= now() AND NOT EXISTS (
        SELECT 1 FROM idempotency_leases AS l
        WHERE l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
          AND l.lease_token = k.lease_token AND l.lease_expires_at > now())) AS lapsed,
    count(*) FILTER (WHERE state = 'completed' AND expires_at <= now()) AS expired_waiting,
    min(created_at) FILTER (WHERE state = 'in_flight') AS oldest_in_flight,
    pg_total_relation_size('idempotency_keys') AS table_bytes
FROM idempotency_keys AS k
"""

# Each table's schema-qualified name, or NULL when it is not there. COMPLETE runs on a
# handler's connection too, whose search_path is the handler's to change (a schema per
# tenant, say): there it names its tables this way.
TABLE_NAMES = """
SELECT (SELECT format('%I.%I', n.nspname, c.relname)
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE c.oid = to_regclass('idempotency_keys')) AS keys,
       (SELECT format('%I.%I', n.nspname, c.relname)
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE c.oid = to_regclass('idempotency_leases')) AS leases
"""


def qualified(statement: str, keys: str, leases: str) -> str:
    """`statement` with the two tables named as `keys` and `leases` (from TABLE_NAMES)."""
    return statement.replace("idempotency_keys", keys).replace("idempotency_leases", leases)


# Whether the schema is there at all (to_regclass answers NULL, where a SELECT would fail).
SCHEMA_TABLES = """
SELECT to_regclass('idempotency_keys') IS NOT NULL AS has_keys,
       to_regclass('idempotency_asgi_version') IS NOT NULL AS has_versions
"""
SCHEMA_VERSION = "SELECT version_num FROM idempotency_asgi_version"

# Held by the one runner of the background maintenance among many workers (session-scoped;
# released when its connection closes or is reset, so a dead runner is replaced).
MAINTENANCE_LOCK = "SELECT pg_try_advisory_lock($1)"
# The claim with a per-tenant bound on stored keys ($11: rows of the tenant, in flight or
# completed, expired ones the reaper has not reached yet included), and the in-flight cap of
# CLAIM_CAPPED as well when $10 is not NULL. Only a key the tenant does not hold yet is
# counted against it (CASE evaluates in order): a replay or a conflict costs what CLAIM does,
# a new key a walk of the tenant's primary-key entries, up to $11. The ORDER BY is the
# index's own order, and keeps the walk on it: without, the generic plan of the prepared
# statement read the whole table (23 ms a claim on 400,000 rows, whatever the tenant held).
# As for CLAIM_CAPPED, the counts are not serialised against concurrent claims: a burst may
# overshoot by a few; it bounds abuse, it is not a quota.
CLAIM_BOUNDED = f"""
WITH busy AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM idempotency_keys AS k
        WHERE tenant_id = $1 AND state = 'in_flight'
          AND (lease_expires_at > now() OR EXISTS (
              SELECT 1 FROM idempotency_leases AS l
              WHERE l.tenant_id = $1 AND l.idempotency_key = k.idempotency_key
                AND l.lease_token = k.lease_token AND l.lease_expires_at > now()))
        LIMIT coalesce($10, 0)
    ) AS capped
),
stored AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM idempotency_keys WHERE tenant_id = $1
        ORDER BY idempotency_key LIMIT $11
    ) AS capped
),
refused AS (
    SELECT CASE
        WHEN EXISTS (
            SELECT 1 FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2
        ) THEN NULL
        WHEN (SELECT n FROM stored) >= $11 THEN 'over_quota'
        WHEN $10 IS NOT NULL AND (SELECT n FROM busy) >= $10 THEN 'over_limit'
    END AS state
),
inserted AS (
    INSERT INTO idempotency_keys ({_NEW_ROW_COLUMNS})
    SELECT {_NEW_ROW_VALUES}
    WHERE (SELECT state FROM refused) IS NULL
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING 1
),
existing AS ({_EXISTING}
)
{_CLAIMED}
UNION ALL
SELECT * FROM existing
UNION ALL
SELECT false, state, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM refused
WHERE state IS NOT NULL AND NOT EXISTS (SELECT 1 FROM inserted)
  AND NOT EXISTS (SELECT 1 FROM existing)
"""
