"""Reconciliation's statements (see `_postgres/reconcile.py`): a key held for an operator, the
list of held keys, and an operator's settle or release of one.

A held key is in flight with `held_reason` set, and `lease_expires_at` until when it is
held; nobody renews it. A key in flight past its lease with no reason is listed too (its
owner died or stalled: `lease-lapsed`, never stored).

Settling and releasing never race a request. Each is one statement, fenced like a takeover
(claiming.TAKE_OVER): it tries the request's advisory lock and then the key's (shared, for
the statement only, never waited for: an atomic request holds both, exclusive, while it
runs), it changes the row only while its `lease_token` is the one the operator's look read
(compare-and-set: a retry that takes the key over meanwhile and a settle cannot both win),
and only while the row is still settleable: held, or past its lease, or (when asked)
completed. A row another transaction holds (a completion whose COMMIT is under way) is
skipped, never waited for.
"""

from ..._records import HeldReason
from .rows import lease_end
from .waiting import CHANNEL, waited_for, wake_token

_WAKE_TOKEN = wake_token("$1", "$2")
_WAITED_FOR = waited_for("$1", "$2")
_LAPSED = HeldReason.LEASE_LAPSED.value

# A plain or two-phase request's key held after an unknown outcome ($4: why), in flight until
# $5 seconds from now, fenced by its lease token ($3). The key row itself, not the lease
# table: the run has ended (nothing renews it, and nothing of it will complete the row).
HOLD_LEASE = """
UPDATE idempotency_keys
SET held_reason = $4, lease_expires_at = now() + make_interval(secs => $5)
WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3 AND completed_at IS NULL
"""

# The columns `held` shows, of key row `k` whose lease ends at `ends`.
_SHOWN = """k.tenant_id, k.idempotency_key, k.method, k.path, k.created_at,
       coalesce(k.held_reason, '{lapsed}') AS reason, {ends} AS held_until"""

# Held keys of every tenant, and keys in flight past their lease, claimed at least $2
# seconds ago, oldest first; at most $1 of them. An operator's read, over every shard on
# Citus: the lease rows joined on the distribution column, as the sweeper's (upkeep.SWEEP).
HELD = f"""
SELECT {_SHOWN.format(lapsed=_LAPSED, ends="greatest(k.lease_expires_at, l.lease_expires_at)")}
FROM idempotency_keys AS k
LEFT JOIN idempotency_leases AS l
       ON l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
      AND l.lease_token = k.lease_token
WHERE k.state = 'in_flight' AND k.created_at <= now() - make_interval(secs => $2)
  AND (k.held_reason IS NOT NULL
       OR greatest(k.lease_expires_at, l.lease_expires_at) <= now())
ORDER BY k.created_at, k.tenant_id, k.idempotency_key
LIMIT $1
"""

_TENANT_LEASE_END = lease_end("k", "$1", "k.idempotency_key")

# HELD for one tenant ($1): routed to its shard. $2: at most; $3: claimed at least so long ago.
HELD_TENANT = f"""
SELECT {_SHOWN.format(lapsed=_LAPSED, ends=_TENANT_LEASE_END)}
FROM idempotency_keys AS k
WHERE k.tenant_id = $1 AND k.state = 'in_flight'
  AND k.created_at <= now() - make_interval(secs => $3)
  AND (k.held_reason IS NOT NULL OR {_TENANT_LEASE_END} <= now())
ORDER BY k.created_at, k.idempotency_key
LIMIT $2
"""

# The request's lock ($4) then the key's ($5), tried shared for this statement only, as every
# claim tries them (see claiming.py): free, no request runs the key.
_LOCKS = """locks AS (
    SELECT CASE WHEN pg_try_advisory_xact_lock_shared($4)
                THEN pg_try_advisory_xact_lock_shared($5) ELSE false END AS free
)"""


def _target(completed: str) -> str:
    """The key's row, locked, while it is still the one read ($3: its token) and may be
    changed by an operator: held, or in flight past its lease, or completed when `completed`
    (a parameter) says so; and only while no request holds the key's locks."""
    return f"""target AS (
    SELECT 1 FROM idempotency_keys AS k
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3
      AND ((state = 'in_flight'
            AND (held_reason IS NOT NULL OR {lease_end("k", "$1", "$2")} <= now()))
           OR (state = 'completed' AND {completed}))
      AND (SELECT free FROM locks)
    FOR UPDATE SKIP LOCKED
)"""


# The key's record becomes the operator's answer, written as a completion writes one (see
# recording.COMPLETE): every retry of the request replays it. $6: a new lease token (anything
# that read the old row is fenced off), $7-$9 the answer (status, headers as
# `_records.encode_headers` makes them, body), $10 its retention in seconds (NULL: the
# key's own, as its claim set it from the application's `ttl_seconds`), counted from now,
# $11 the stored-response format, $12 whether a completed record may be replaced. The answer:
# whether the locks were free, and the record's expiry (NULL: nothing was changed).
SETTLE = f"""
WITH {_LOCKS},
{_target("$12")},
settled AS (
    UPDATE idempotency_keys
    SET state = 'completed', lease_token = $6, held_reason = NULL, format_version = $11,
        response_status = $7, response_headers = $8, response_body = $9,
        completed_at = statement_timestamp(),
        expires_at = statement_timestamp()
            + coalesce(make_interval(secs => $10::float8), expires_at - created_at)
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3
      AND EXISTS (SELECT 1 FROM target)
    RETURNING expires_at, has_waiters
)
SELECT (SELECT free FROM locks) AS free, (SELECT expires_at FROM settled) AS expires_at,
       CASE WHEN EXISTS (SELECT 1 FROM settled)
                 AND (EXISTS (SELECT 1 FROM settled WHERE has_waiters) OR {_WAITED_FOR})
            THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END AS woken
"""

# The key freed at once, with its lease row: the next retry runs the request. $6: whether a
# completed record may be freed too. The answer: whether the locks were free, and whether
# the row was deleted.
RELEASE_KEY = f"""
WITH {_LOCKS},
{_target("$6")},
gone AS (
    DELETE FROM idempotency_keys
    WHERE tenant_id = $1 AND idempotency_key = $2 AND lease_token = $3
      AND EXISTS (SELECT 1 FROM target)
    RETURNING has_waiters
),
lease AS (
    DELETE FROM idempotency_leases
    WHERE tenant_id = $1 AND idempotency_key = $2 AND EXISTS (SELECT 1 FROM gone)
    RETURNING has_waiters
)
SELECT (SELECT free FROM locks) AS free, EXISTS (SELECT 1 FROM gone) AS released,
       CASE WHEN EXISTS (SELECT 1 FROM gone WHERE has_waiters)
                 OR EXISTS (SELECT 1 FROM lease WHERE has_waiters)
            THEN pg_notify('{CHANNEL}', {_WAKE_TOKEN}) END AS woken
"""
