"""The statements that end or extend a claim (see `_postgres/recording.py`): the completion, the
release, the renewal. Every one filters by tenant_id first and is fenced by the lease token:
an owner that lost its key (taken over, swept) changes nothing.

Renewals go to a table of their own, `idempotency_leases`, never to the key row: in
transactional mode the key row is completed inside the handler's transaction, and under
REPEATABLE READ or SERIALIZABLE PostgreSQL refuses to update a row that another transaction
changed after the handler's snapshot was taken. A key's lease lasts until the later of its
row's `lease_expires_at` (set by the claim) and the renewal of the same token, if any.
"""

from .waiting import CHANNEL, waited_for, wake_token

_WAKE_TOKEN = wake_token("$1", "$2")
_WAITED_FOR = waited_for("$1", "$2")

# Completion and release wake waiting duplicates, if there are any: NOTIFY is only evaluated
# for such keys, so nobody else pays for it. Inside the request's transaction the
# notification goes out on commit, not before. Completion leaves the lease row alone
# (deleting it could meet a renewal made after the handler's snapshot): the sweeper forgets
# lease rows once they are long past. Its times are the statement's, not now(): inside the
# handler's transaction now() is when that transaction began, and retention counts from when
# the answer was recorded (a handler that spent longer than the retention in its transaction
# would otherwise commit a record already expired). statement_timestamp() is STABLE, which a
# table distributed by Citus accepts in an UPDATE (clock_timestamp(), VOLATILE, it refuses).
COMPLETE = f"""
WITH done AS (
    UPDATE idempotency_keys
    SET state = 'completed', format_version = $4, response_status = $5,
        response_headers = $6, response_body = $7, held_reason = NULL,
        completed_at = statement_timestamp(),
        expires_at = statement_timestamp() + make_interval(secs => $8)
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
    RETURNING expires_at, has_waiters
)
SELECT expires_at,
       CASE WHEN has_waiters OR {_WAITED_FOR} THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END
FROM done
"""

# COMPLETE inside a handler's transaction, finding the key's row by the ctid its claim
# returned ($9), as a TID scan. At SERIALIZABLE a statement that finds its row through the
# primary key's index holds a predicate lock on that index's page until its transaction's
# end; the completion then writes the row, and the index's page gains an entry: two
# requests' completions on neighbouring keys each read what the other wrote, and one of
# them failed to serialize for nothing but the page they shared (14 of 200 at once, with no
# statement of the handlers' own). Found by its ctid, the row is the only thing it reads. A
# row that moved since its claim (a new version by another transaction) is not reached:
# the store then runs COMPLETE, which finds it by its key.
COMPLETE_BY_ROW = f"""
WITH done AS (
    UPDATE idempotency_keys
    SET state = 'completed', format_version = $4, response_status = $5,
        response_headers = $6, response_body = $7, held_reason = NULL,
        completed_at = statement_timestamp(),
        expires_at = statement_timestamp() + make_interval(secs => $8)
    WHERE ctid = $9 AND tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3
      AND completed_at IS NULL
    RETURNING expires_at, has_waiters
)
SELECT expires_at,
       CASE WHEN has_waiters OR {_WAITED_FOR} THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END
FROM done
"""

# One row when it freed the key (none when this lease no longer held it).
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
SELECT CASE WHEN gone.has_waiters OR EXISTS (SELECT 1 FROM lease WHERE lease.has_waiters)
            THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END
FROM gone
"""

# A renewal writes the lease table only (see above), and only while the key row is still in
# flight under this token: otherwise it writes nothing and says the lease is lost. A row of an
# earlier token (a takeover's predecessor) is overwritten; its waiters stay. It writes the
# key row's own tenant, key and token (equal to $1-$3): an INSERT ... SELECT that takes the
# distribution column from the co-located table it reads is one that Citus runs on the
# tenant's shard, where one writing $1 would be run through the coordinator.
RENEW = """
INSERT INTO idempotency_leases (tenant_id, idempotency_key, lease_token, lease_expires_at)
SELECT tenant_id, idempotency_key, lease_token, now() + make_interval(secs => $4)
FROM idempotency_keys
WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
SET lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at
"""

# Whether this lease still holds its key (in flight under its token): asked when a completion
# failed in a way that may mean the key was taken over meanwhile.
HOLDS = """
SELECT EXISTS (
    SELECT 1 FROM idempotency_keys
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
)
"""

# -- batched (see _postgres/batching.py and claiming.py) -------------------------------------------
# Each finds the input's rows still in flight under their lease token (`target`: each found by
# a probe of the primary key), and reaches them by their ctid, as a TID scan (`ctid = ANY
# (ARRAY(...))`): joined to them by key, it was planned as a hash join over a scan of the
# whole table, and completions slowed as the table grew. A row updated by another transaction
# while the statement runs (an operator's, a trigger's, an older version's waiter mark) has a
# new ctid and is not reached: the store then runs that row's one-row statement, which finds
# it by its key (see `_recording.Records`). A row this statement did not reach is never taken
# for a lost lease on its word alone.

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
        held_reason = NULL, completed_at = statement_timestamp(),
        expires_at = statement_timestamp() + make_interval(secs => t.ttl_seconds)
    FROM target AS t
    WHERE {_HELD_ROW}
    RETURNING t.n, k.tenant_id, k.idempotency_key, k.expires_at, k.has_waiters
)
SELECT d.n, d.expires_at,
       CASE WHEN d.has_waiters OR {waited_for("d.tenant_id", "d.idempotency_key", per_row=True)}
            THEN pg_notify('{CHANNEL}', {wake_token("d.tenant_id", "d.idempotency_key")}) END
FROM done AS d
"""

RELEASE_MANY = f"""
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])
        WITH ORDINALITY AS i(tenant_id, idempotency_key, lease_token, n)
),
{_HELD}
gone AS (
    DELETE FROM idempotency_keys AS k
    USING target AS t
    WHERE {_HELD_ROW}
    RETURNING t.n, k.tenant_id, k.idempotency_key, k.has_waiters
),
lease AS (
    DELETE FROM idempotency_leases AS l
    USING gone AS g
    WHERE l.tenant_id = g.tenant_id AND l.idempotency_key = g.idempotency_key
    RETURNING l.tenant_id, l.idempotency_key, l.has_waiters
)
SELECT g.n,
       CASE WHEN g.has_waiters OR EXISTS (
                SELECT 1 FROM lease
                WHERE lease.tenant_id = g.tenant_id AND lease.idempotency_key = g.idempotency_key
                  AND lease.has_waiters)
            THEN pg_notify('{CHANNEL}', {wake_token("g.tenant_id", "g.idempotency_key")}) END
FROM gone AS g
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
SELECT i.n
FROM input AS i
JOIN renewed AS r
  ON r.tenant_id = i.tenant_id AND r.idempotency_key = i.idempotency_key
 AND r.lease_token = i.lease_token
"""
