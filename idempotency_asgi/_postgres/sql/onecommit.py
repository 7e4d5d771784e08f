"""The atomic mode's two round trips (see `_postgres/onecommit.py`): its functions, and the
simple queries that call them.

A new key costs the store two round trips of its own, each one simple query:

1. `BEGIN; SELECT FROM generate_series(1, idempotency_asgi_claim(...))`: the transaction
   begins, and the claim function tries the request's lock and then the key's (the
   session's, tried, never waited for: see claiming.py for why in that order), reads the
   key's row in a statement of its own once they are held (a VOLATILE function's statements
   each take a snapshot of their own: one taken before the lock could miss a record
   committed just before the lock came free), clears a row past its retention, and says
   what it found. A simple query returns nothing but the last statement's status, so the
   outcome is a small number, said as the number of rows of that last statement (`SELECT 1`:
   claimed). A function's statements are planned once per connection: the same SQL written
   inline would be planned on every request.
2. `SELECT idempotency_asgi_record(...); COMMIT; SELECT pg_advisory_unlock(...), ...,
   pg_advisory_unlock_all(); <the rest of the session's reset>`: the record, the COMMIT,
   the locks let go of (the key's, then the request's, in the statement that lets the
   session's every lock go) and the reset a connection lent to a handler needs, in one
   round trip. The record function refuses (IA001) when the handler ended the request's
   transaction itself, however it began another, and the server then skips everything
   after it.

How a transaction the handler ended is told, without a round trip of its own: the claim
marks the run twice with a number of its own, in a setting of the transaction's
(`idempotency_asgi.txn`, gone when that transaction ends, however it ends) and in one of the
session's (`idempotency_asgi.run`, which a ROLLBACK of the transaction that set it takes
back, and a COMMIT keeps). The record finds the first missing when the transaction is not
the claim's any more. After our own ROLLBACK, the second still there says that the handler
committed the claim's transaction before (`idempotency_asgi_rolled_back`), even when what we
rolled back was a later transaction the handler left aborted. The two-phase mode marks its
transaction the same way at BEGIN (`marked`), and checks it in its completion.

Whatever does not end with the record ends with ROLLBACK, that check, the locks and the
reset in one round trip, or with the key held (`idempotency_asgi_hold`, for OutcomeUnknown
and a handler that ended the transaction), written and committed before the locks are let
go of.

Every value in these queries is written by `literals.literal`; numbers (the locks) by
Python's int formatting. The functions live in the key table's schema and name it with
that schema, as every statement on a handler's connection must (its search_path is the
handler's to change).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from .literals import literal
from .session import reset_unlocking
from .waiting import CHANNEL, wake_token


class Found(enum.IntEnum):
    """What the claim function says, as the number of rows of the claim's statement."""

    CLAIMED = 1  # a new key: the locks are held, the transaction is the request's
    EXPIRED = 2  # a record past its retention was cleared: run as new
    TAKEN_OVER = 3  # an in-flight row whose lease lapsed (same request) was cleared
    LOCKED = 4  # this request is in flight (its lock is held): 409
    MISMATCH = 5  # another request holds the key, or its row is another request's: 422
    COMPLETED = 6  # the same request, finished: its record is read next, to replay
    IN_FLIGHT = 7  # a row in flight under a live lease (another mode's, or a held key)
    OVER_QUOTA = 8  # a new key, and the tenant already stores its bound of keys


#: The SQLSTATE the functions raise when the request's transaction is not the one the claim
#: began (the handler ended it itself).
ENDED = "IA001"
#: And the two-phase completion's when its lease no longer holds the key.
LOST = "IA002"

# Installed into the key table's schema (format's %1$I), so that every table the functions
# read is named with its schema. A DO block, since a revision is plain SQL and the schema
# is known only where it runs.
_INSTALL = """
DO $install$
BEGIN
EXECUTE format($ddl${ddl}$ddl$, current_schema());
END
$install$
"""

_CLAIM = """
CREATE OR REPLACE FUNCTION %1$I.idempotency_asgi_claim(
    p_tenant text, p_key text, p_fingerprint bytea, p_key_lock bigint,
    p_request_lock bigint, p_bound bigint, p_run text)
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    found_row record;
    outcome integer := 1;
BEGIN
    -- The request's lock, then the key's (claiming.py says why in that order); the
    -- session's, so that a handler's own COMMIT lets no duplicate in.
    IF NOT pg_try_advisory_lock(p_request_lock) THEN
        RETURN 4;
    END IF;
    IF NOT pg_try_advisory_lock(p_key_lock) THEN
        PERFORM pg_advisory_unlock(p_request_lock);
        RETURN 5;
    END IF;
    -- A statement of its own, after the locks: its snapshot sees every record committed
    -- before they came free. (Conditions below are kept free of subqueries where a new key
    -- passes: PL/pgSQL evaluates a plain expression without the executor.)
    SELECT k.state, k.fingerprint = p_fingerprint AS same_request, k.lease_token,
           k.state = 'completed' AND k.expires_at <= now() AS expired, k.lease_expires_at
      INTO found_row
      FROM %1$I.idempotency_keys AS k
     WHERE k.tenant_id = p_tenant AND k.idempotency_key = p_key;
    IF FOUND THEN
        IF found_row.expired THEN
            outcome := 2;
        ELSIF NOT found_row.same_request THEN
            outcome := 5;
        ELSIF found_row.state = 'completed' THEN
            outcome := 6;
        ELSIF greatest(found_row.lease_expires_at, (
                  SELECT l.lease_expires_at FROM %1$I.idempotency_leases AS l
                  WHERE l.tenant_id = p_tenant AND l.idempotency_key = p_key
                    AND l.lease_token = found_row.lease_token)) > now() THEN
            outcome := 7;  -- in flight under a live lease (a renewal's included)
        ELSE
            outcome := 3;
        END IF;
        IF outcome IN (2, 3) THEN
            -- Cleared in this transaction (it comes back if this rolls back); never waited
            -- for: a row another transaction is writing (the reaper, a late owner's
            -- completion) is about to change, and the key is in flight meanwhile.
            PERFORM 1 FROM %1$I.idempotency_keys
             WHERE tenant_id = p_tenant AND idempotency_key = p_key
               AND lease_token = found_row.lease_token
               FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                DELETE FROM %1$I.idempotency_keys
                 WHERE tenant_id = p_tenant AND idempotency_key = p_key
                   AND lease_token = found_row.lease_token;
            ELSE
                outcome := 7;
            END IF;
        END IF;
    ELSIF p_bound IS NOT NULL THEN
        IF (SELECT count(*) FROM (
                SELECT 1 FROM %1$I.idempotency_keys WHERE tenant_id = p_tenant
                ORDER BY idempotency_key LIMIT p_bound) AS capped) >= p_bound THEN
            outcome := 8;
        END IF;
    END IF;
    IF outcome > 3 THEN
        -- The key's lock first: whoever then finds the request's free finds the key's free.
        PERFORM pg_advisory_unlock(p_key_lock);
        PERFORM pg_advisory_unlock(p_request_lock);
        RETURN outcome;
    END IF;
    -- The run's marks (see the module): the transaction's, and the session's.
    PERFORM set_config('idempotency_asgi.txn', p_run, true),
            set_config('idempotency_asgi.run', p_run, false);
    RETURN outcome;
END
$fn$
"""

_WAKE = wake_token("p_tenant", "p_key")

_RECORD = f"""
CREATE OR REPLACE FUNCTION %1$I.idempotency_asgi_record(
    p_tenant text, p_key text, p_method text, p_path text, p_fingerprint bytea,
    p_token bigint, p_format integer, p_status integer, p_headers bytea, p_body bytea,
    p_expires_us bigint, p_replaced boolean, p_run text)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    -- The transaction the claim began, or another (p_run NULL: the answer is recorded on
    -- its own, after that transaction rolled back).
    IF p_run IS NOT NULL
       AND current_setting('idempotency_asgi.txn', true) IS DISTINCT FROM p_run THEN
        RAISE EXCEPTION 'the handler ended the request''s transaction itself'
              USING ERRCODE = '{ENDED}';
    END IF;
    -- A plain INSERT: the claim cleared any row it may replace, and a row there after all
    -- (a writer that took no lock) fails it, and everything rolls back.
    INSERT INTO %1$I.idempotency_keys (
        tenant_id, idempotency_key, method, path, fingerprint, state, lease_token,
        lease_expires_at, format_version, response_status, response_headers, response_body,
        created_at, completed_at, expires_at)
    VALUES (p_tenant, p_key, p_method, p_path, p_fingerprint, 'completed', p_token,
            statement_timestamp(), p_format, p_status, p_headers, p_body,
            now(), statement_timestamp(),
            timestamptz 'epoch' + p_expires_us * interval '1 microsecond');
    -- Duplicates may wait only on a row; one replaced may have had some.
    IF p_replaced THEN
        IF EXISTS (
            SELECT 1 FROM %1$I.idempotency_leases
            WHERE tenant_id = p_tenant AND idempotency_key = p_key AND has_waiters) THEN
            PERFORM pg_notify('{CHANNEL}', {_WAKE});
        END IF;
    END IF;
END
$fn$
"""

_ROLLED_BACK = f"""
CREATE OR REPLACE FUNCTION %1$I.idempotency_asgi_rolled_back(p_run text)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    -- After our ROLLBACK the session's mark is gone with the transaction that set it,
    -- unless the handler committed that transaction first.
    IF current_setting('idempotency_asgi.run', true) = p_run THEN
        RAISE EXCEPTION 'the handler committed the request''s transaction itself'
              USING ERRCODE = '{ENDED}';
    END IF;
END
$fn$
"""

_HOLD = """
CREATE OR REPLACE FUNCTION %1$I.idempotency_asgi_hold(
    p_tenant text, p_key text, p_method text, p_path text, p_fingerprint bytea,
    p_token bigint, p_lease_seconds float8, p_ttl_seconds float8, p_format integer,
    p_reason text)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    -- In flight under a lease nobody renews: no retry runs until it lapses. In place of a
    -- row the claim could have replaced (it is back: the claim's transaction rolled back).
    INSERT INTO %1$I.idempotency_keys AS k (
        tenant_id, idempotency_key, method, path, fingerprint, state, lease_token,
        lease_expires_at, format_version, expires_at, held_reason)
    VALUES (p_tenant, p_key, p_method, p_path, p_fingerprint, 'in_flight', p_token,
            now() + make_interval(secs => p_lease_seconds), p_format,
            now() + make_interval(secs => p_ttl_seconds), p_reason)
    ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
    SET method = EXCLUDED.method, path = EXCLUDED.path, fingerprint = EXCLUDED.fingerprint,
        state = 'in_flight', lease_token = EXCLUDED.lease_token,
        lease_expires_at = EXCLUDED.lease_expires_at, format_version = EXCLUDED.format_version,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at,
        held_reason = EXCLUDED.held_reason
    WHERE k.tenant_id = p_tenant
      AND ((k.state = 'completed' AND k.expires_at <= now())
           OR (k.completed_at IS NULL AND k.fingerprint = p_fingerprint
               AND greatest(k.lease_expires_at, (
                   SELECT l.lease_expires_at FROM %1$I.idempotency_leases AS l
                   WHERE l.tenant_id = p_tenant AND l.idempotency_key = p_key
                     AND l.lease_token = k.lease_token)) <= now()));
END
$fn$
"""

# The two-phase mode's completion inside the handler's transaction (see transaction.py),
# called in the COMMIT's round trip: fenced by the lease's token, the row found by the ctid
# its claim returned (a TID scan: see recording.COMPLETE_BY_ROW for why) or, when it moved
# since, by its key. A lease lost (LOST) or a transaction that is not the one the lender
# began (ENDED) raises, and the server skips the COMMIT after it.
_COMPLETE = f"""
CREATE OR REPLACE FUNCTION %1$I.idempotency_asgi_complete(
    p_tenant text, p_key text, p_token bigint, p_format integer, p_status integer,
    p_headers bytea, p_body bytea, p_expires_us bigint, p_run text, p_row tid)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    waiters boolean;
BEGIN
    IF current_setting('idempotency_asgi.txn', true) IS DISTINCT FROM p_run THEN
        RAISE EXCEPTION 'the handler ended the request''s transaction itself'
              USING ERRCODE = '{ENDED}';
    END IF;
    UPDATE %1$I.idempotency_keys
       SET state = 'completed', format_version = p_format, response_status = p_status,
           response_headers = p_headers, response_body = p_body, held_reason = NULL,
           completed_at = statement_timestamp(),
           expires_at = timestamptz 'epoch' + p_expires_us * interval '1 microsecond'
     WHERE ctid = p_row AND tenant_id = p_tenant AND idempotency_key = p_key
       AND lease_token = p_token AND completed_at IS NULL
    RETURNING has_waiters INTO waiters;
    IF NOT FOUND THEN
        UPDATE %1$I.idempotency_keys
           SET state = 'completed', format_version = p_format, response_status = p_status,
               response_headers = p_headers, response_body = p_body, held_reason = NULL,
               completed_at = statement_timestamp(),
               expires_at = timestamptz 'epoch' + p_expires_us * interval '1 microsecond'
         WHERE tenant_id = p_tenant AND idempotency_key = p_key
           AND lease_token = p_token AND completed_at IS NULL
        RETURNING has_waiters INTO waiters;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'the lease no longer holds the key' USING ERRCODE = '{LOST}';
        END IF;
    END IF;
    IF waiters OR EXISTS (
        SELECT 1 FROM %1$I.idempotency_leases
        WHERE tenant_id = p_tenant AND idempotency_key = p_key AND has_waiters) THEN
        PERFORM pg_notify('{CHANNEL}', {_WAKE});
    END IF;
END
$fn$
"""

#: Revision 0006's statements: the functions, in the key table's schema.
INSTALL = tuple(
    _INSTALL.format(ddl=ddl) for ddl in (_CLAIM, _RECORD, _ROLLED_BACK, _HOLD, _COMPLETE)
)

#: And its downgrade.
UNINSTALL = (
    "DROP FUNCTION IF EXISTS idempotency_asgi_claim(text, text, bytea, bigint, bigint, "
    "bigint, text)",
    "DROP FUNCTION IF EXISTS idempotency_asgi_record(text, text, text, text, bytea, bigint, "
    "integer, integer, bytea, bytea, bigint, boolean, text)",
    "DROP FUNCTION IF EXISTS idempotency_asgi_rolled_back(text)",
    "DROP FUNCTION IF EXISTS idempotency_asgi_hold(text, text, text, text, bytea, bigint, "
    "float8, float8, integer, text)",
    "DROP FUNCTION IF EXISTS idempotency_asgi_complete(text, text, bigint, integer, integer, "
    "bytea, bytea, bigint, text, tid)",
)


def _call(schema: str, name: str, args: Sequence[object]) -> str:
    return f"{schema}.idempotency_asgi_{name}({', '.join(map(literal, args))})"


#: What BEGIN says for each isolation level a request's transaction may be given.
BEGINS = {
    None: "BEGIN",
    "read committed": "BEGIN ISOLATION LEVEL READ COMMITTED",
    "repeatable read": "BEGIN ISOLATION LEVEL REPEATABLE READ",
    "serializable": "BEGIN ISOLATION LEVEL SERIALIZABLE",
}


def claim(
    schema: str,
    begin: str,
    *,
    tenant: str,
    key: str,
    fingerprint: bytes,
    key_lock: int,
    request_lock: int,
    bound: int | None,
    run: int,
) -> str:
    """The first round trip: BEGIN and the claim (its status: `SELECT <Found>`)."""
    args = (tenant, key, fingerprint, key_lock, request_lock, bound, str(run))
    call = _call(schema, "claim", args)
    return f"{begin}; SELECT FROM generate_series(1, {call})"


class Ending(NamedTuple):
    """A round trip that ends the request's transaction: what runs in it before the
    `verb` (COMMIT or ROLLBACK; none when the handler ended the transaction already), the
    verb, and what runs after it. Kept apart so that the store can end asyncpg's own view of
    the transaction with it (see asyncpg_transactions.end)."""

    before: str
    verb: str
    after: str

    @property
    def text(self) -> str:
        if not self.verb:
            return f"{self.before}{self.after}"
        return f"{self.before}{self.verb}; {self.after}" if self.after else self.before + self.verb


def record(schema: str, key_lock: int, request_lock: int, args: Sequence[object]) -> Ending:
    """The second: the record, COMMIT, the locks let go of, the reset."""
    return Ending(
        f"SELECT {_call(schema, 'record', args)}; ",
        "COMMIT",
        reset_unlocking(key_lock, request_lock),
    )


def rollback(schema: str, key_lock: int, request_lock: int, run: int) -> Ending:
    """ROLLBACK, checked (see the module), the locks let go of, the reset."""
    after = f"{rolled_back(schema, run)}{reset_unlocking(key_lock, request_lock)}"
    return Ending("", "ROLLBACK", after)


def hold(
    schema: str, key_lock: int, request_lock: int, args: Sequence[object], *, rollback: bool
) -> Ending:
    """The key held (written and committed while the locks are still held), then the locks
    let go of and the reset; after a ROLLBACK of what is still open when `rollback`."""
    return Ending(
        "",
        "ROLLBACK" if rollback else "",
        f"BEGIN; SELECT {_call(schema, 'hold', args)}; COMMIT; "
        + reset_unlocking(key_lock, request_lock),
    )


def rolled_back(schema: str, run: int) -> str:
    """The check after a ROLLBACK (IA001: the handler had committed the transaction)."""
    return f"SELECT {schema}.idempotency_asgi_rolled_back('{int(run)}'); "


def complete(schema: str, args: Sequence[object], row: tuple[int, int] | None) -> str:
    """The two-phase completion, to go before its transaction's COMMIT (see `_COMPLETE`)."""
    found = "NULL" if row is None else f"'({int(row[0])},{int(row[1])})'::tid"
    return f"SELECT {_call(schema, 'complete', args)[:-1]}, {found}); "


def marked(run: int) -> str:
    """What the two-phase mode's BEGIN says after itself: the run's marks (see the module).
    Settings only: nothing takes the transaction's snapshot, so a handler may still SET
    TRANSACTION ISOLATION LEVEL."""
    return f"SET LOCAL idempotency_asgi.txn = '{int(run)}'; SET idempotency_asgi.run = '{int(run)}'"


def release(key_lock: int, request_lock: int) -> Ending:
    """The locks let go of and the reset, with nothing to roll back (the handler ended the
    transaction, or its COMMIT failed and rolled it back)."""
    return Ending("", "", reset_unlocking(key_lock, request_lock))
