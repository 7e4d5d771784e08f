"""How a keyed request ends: one `Settlement` per request, and the one table that says, for
each, what the client is answered, what becomes of the key, and how it is reported.

Every keyed request the middleware answers is reported exactly once, with its settlement:
the log line's `outcome` and level, the metric's `outcome` label and the span's attribute
all come from this table. The contract page's "What happens when" table (docs/contract.md) is
this table, rendered (`scripts/doc-tables`); a test keeps the two equal.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass


class Fate(enum.Enum):
    """What the key's row is after the request, in a word."""

    NONE = "none"  # nothing was ever reserved: no row
    UNCHANGED = "unchanged"  # the row as it was (a replay, a refusal, a duplicate's)
    RECORDED = "recorded"  # completed, with the answer to replay
    RECORDED_WITHOUT_BODY = "recorded without its body"  # completed, not replayable
    RELEASED = "released"  # deleted: the next retry runs fresh
    HELD = "held"  # in flight, renewed by nobody, until its lease lapses
    COMMITTING = "committing"  # in flight until its COMMIT ends (then recorded or released)
    ANOTHERS = "another owner's"  # taken over: the row belongs to the attempt that took it


@dataclass(frozen=True)
class Case:
    #: what happened, as the contract page's table says it
    situation: str
    #: what the client is answered
    answer: str
    #: what becomes of the key, in a word and in words
    fate: Fate
    key: str
    #: the telemetry outcome (log field, metric label, span attribute)
    outcome: str
    #: the log level of the request's line
    level: int
    #: the problem type answered, when the answer is one of the middleware's problems
    problem: str | None = None
    #: the status answered, when it is always the same
    status: int | None = None
    #: the log line carries the error's traceback: a fault in the application's own code
    traceback: bool = False


_NOTHING = "nothing reserved; the app does not run"
_UNCHANGED = "unchanged; the app does not run"
_RECORDED = "recorded: retries get the replay until the retention ends"
_RELEASED = "released: the next retry runs fresh"
_ROLLED_BACK_RELEASED = (
    "rolled back and released (left to its lease if the database cannot be reached)"
)


class Settlement(enum.Enum):
    UNAUTHENTICATED = Case(
        "the tenant resolver returns None, or an id PostgreSQL cannot store (a NUL, a lone "
        "surrogate, more than 1,024 bytes), for a request the middleware answers (a key "
        "sent, or one required)",
        "401 `unauthenticated` (+ `WWW-Authenticate` when `www_authenticate` names the "
        "scheme); checked first, before the key",
        Fate.NONE,
        _NOTHING,
        "rejected",
        logging.INFO,
        "unauthenticated",
        401,
    )
    TENANT_FAILED = Case(
        "the tenant resolver raises, or returns neither a str nor None, for a request the "
        "middleware answers",
        "500 `tenant-resolver-failed` (no tenant is guessed); checked first, before the key",
        Fate.NONE,
        _NOTHING,
        "tenant_error",
        logging.ERROR,
        "tenant-resolver-failed",
        500,
        traceback=True,
    )
    MISSING_KEY = Case(
        "covered method, no key, key required",
        "400 `missing-key`",
        Fate.NONE,
        _NOTHING,
        "rejected",
        logging.INFO,
        "missing-key",
        400,
    )
    INVALID_KEY = Case(
        "key empty, > 255 characters, not visible ASCII, or sent twice",
        '400 `invalid-key` (`"abc"`, an RFC 8941 string, means `abc`)',
        Fate.NONE,
        _NOTHING,
        "rejected",
        logging.INFO,
        "invalid-key",
        400,
    )
    BODY_TOO_LARGE = Case(
        "body larger than `max_body_bytes`",
        "413 `body-too-large`",
        Fate.NONE,
        _NOTHING,
        "rejected",
        logging.INFO,
        "body-too-large",
        413,
    )
    STORE_UNAVAILABLE = Case(
        "the store is unreachable, slower than `timeout` or shutting down (even before it "
        "ever opened: concurrent requests share one attempt)",
        "503 `store-unavailable` + `Retry-After`, within `timeout`",
        Fate.NONE,
        _NOTHING,
        "store_error",
        logging.WARNING,
        "store-unavailable",
        503,
    )
    STORE_REFUSED = Case(
        "a statement of the store's fails for good, not for an outage (a permission the "
        "role lacks, a value PostgreSQL cannot store)",
        "500 `store-refused`, naming the error; logged as an error",
        Fate.NONE,
        _NOTHING,
        "store_error",
        logging.ERROR,
        "store-refused",
        500,
    )
    NEW = Case(
        "new key",
        "the app runs once; its response is stored, then sent",
        Fate.RECORDED,
        _RECORDED,
        "new",
        logging.INFO,
    )
    EXPIRED = Case(
        "key past its retention",
        "new: the app runs once; its response is stored, then sent",
        Fate.RECORDED,
        _RECORDED,
        "new",
        logging.INFO,
    )
    REPLAYED = Case(
        "same tenant, key and request, finished",
        "the stored response, byte-identical, plus `Idempotent-Replayed: true` (the headers "
        "`replay_headers` names) and `Idempotency-Key-Expires`, the same date the original "
        "carried",
        Fate.UNCHANGED,
        _UNCHANGED,
        "replay",
        logging.INFO,
    )
    MISMATCH = Case(
        "same key, different method, path, query or body (finished or in flight)",
        "422 `key-reused`",
        Fate.UNCHANGED,
        _UNCHANGED,
        "mismatch",
        logging.INFO,
        "key-reused",
        422,
    )
    IN_FLIGHT = Case(
        "same request, still in flight (atomic mode: its transaction holds the key's lock)",
        "409 `request-in-progress`, `Retry-After` = when the first is likely done (see "
        "below), at least 1 s, never beyond its lease (with `wait_seconds`: held until the "
        "first finishes, then its replay; 409 only when the wait runs out)",
        Fate.UNCHANGED,
        _UNCHANGED,
        "conflict",
        logging.INFO,
        "request-in-progress",
        409,
    )
    OVER_LIMIT = Case(
        "a new key while the tenant has `max_in_flight_per_tenant` in flight",
        "429 `too-many-in-flight` + `Retry-After` (replays are never capped)",
        Fate.NONE,
        _NOTHING,
        "over_limit",
        logging.INFO,
        "too-many-in-flight",
        429,
    )
    OVER_QUOTA = Case(
        "a new key while the tenant stores `max_keys_per_tenant` keys (counted at most once "
        "a second per process, so a burst may pass it by a little)",
        "429 `too-many-keys` (replays and keys in flight are never refused)",
        Fate.NONE,
        _NOTHING,
        "over_limit",
        logging.INFO,
        "too-many-keys",
        429,
    )
    NOT_REPLAYABLE = Case(
        "same request, finished, but its response was larger than `max_stored_response_bytes` "
        "(`omitted_replay_header` unset: the default)",
        "409 `response-not-replayable` with `original_status`",
        Fate.UNCHANGED,
        "unchanged: it never runs again under this key",
        "not_replayable",
        logging.INFO,
        "response-not-replayable",
        409,
    )
    OMITTED_REPLAY = Case(
        "the same, with `omitted_replay_header` set (e.g. `Idempotency-Replay`)",
        "the stored status and headers with an empty body, the replay headers, and that "
        "header: `omitted`",
        Fate.UNCHANGED,
        "unchanged: it never runs again under this key",
        "replay",
        logging.INFO,
    )
    UNREADABLE = Case(
        "finished, but stored by a newer format version than this server reads",
        "503 `record-unreadable` (never misread, never rerun)",
        Fate.UNCHANGED,
        _UNCHANGED,
        "store_error",
        logging.WARNING,
        "record-unreadable",
        503,
    )
    TAKEN_OVER = Case(
        "in flight, but its owner died (lease lapsed; an atomic request finds such a row "
        "of a server in another mode, and replaces it when it commits)",
        "taken over: the app runs again under a new lease; its response is stored, then sent",
        Fate.RECORDED,
        _RECORDED + "; the old owner can no longer complete, renew or release it",
        "takeover",
        logging.WARNING,
    )
    RELEASED = Case(
        "the app answers 5xx, one of `release_statuses` (408, 425, 429), or a 307 or 308 "
        "(send the request there: not its outcome, so a client that follows it runs it "
        "once, with the same key, where it is sent; a 301, 302 or 303 is recorded), raises, "
        "or is cancelled",
        "the app's answer (the server's 500 for an exception)",
        Fate.RELEASED,
        _RELEASED + " (transactional and atomic modes: its writes roll back)",
        "released",
        logging.INFO,
    )
    OUTCOME_UNKNOWN = Case(
        "the app raises `OutcomeUnknown`, or an error with one anywhere behind it: raised "
        "from it or while handling it (`from None` too), at any depth, inside exception "
        "groups (a task group's child); also when an error middleware inside (Starlette's, with "
        "the app wrapped in the middleware) answered 500 before raising it",
        "504 `outcome-unknown` + `Retry-After`",
        Fate.HELD,
        "held until its lease lapses (nothing renews it, no retry runs meanwhile); "
        "transactional writes roll back (atomic mode: then the key is held in flight)",
        "outcome_unknown",
        logging.WARNING,
        "outcome-unknown",
        504,
    )
    TRANSACTION_ENDED = Case(
        "the handler ends the request's transaction itself (a COMMIT or a ROLLBACK on the "
        "request's connection; the transactional modes)",
        "500 `transaction-ended-by-handler`; logged as an error",
        Fate.HELD,
        "held until its lease lapses, as for `OutcomeUnknown`: what the handler committed "
        "may have happened; no duplicate ran meanwhile",
        "transaction_ended",
        logging.ERROR,
        "transaction-ended-by-handler",
        500,
    )
    TRANSACTION_IDLE = Case(
        "another session waits on the request's transaction for `transaction_idle_seconds` "
        "while it sits idle (the handler's own session, blocked on a row the request's "
        "transaction wrote; the transactional modes): the waiting statement is cancelled, and "
        "the handler then fails (raises, or answers 5xx)",
        "500 `transaction-idle`; logged as an error",
        Fate.HELD,
        "held until its lease lapses, as for `OutcomeUnknown`: the transaction's writes rolled "
        "back, what the handler wrote elsewhere may have been kept",
        "transaction_idle",
        logging.ERROR,
        "transaction-idle",
        500,
    )
    DATABASE_FAILED = Case(
        "the database fails while the app runs or commits (its transaction's connection "
        "breaks, the server shuts down, BEGIN is slower than `timeout`, a store-unavailable "
        "error, even inside an exception group)",
        "503 `store-unavailable` + `Retry-After`",
        Fate.RELEASED,
        _ROLLED_BACK_RELEASED,
        "store_error",
        logging.WARNING,
        "store-unavailable",
        503,
    )
    COMMIT_PENDING = Case(
        "the COMMIT is slower than `timeout` (a synchronous standby gone, a slow deferred trigger)",
        "503 `store-unavailable` + `Retry-After`, within `timeout`",
        Fate.COMMITTING,
        "the COMMIT goes on, never cancelled: recorded if it lands (a retry gets its "
        "replay), released if it fails, left to its lease if its connection is lost",
        "store_error",
        logging.WARNING,
        "store-unavailable",
        503,
    )
    RECORDED_APART = Case(
        "the app catches a database error and answers 4xx (its transaction is aborted)",
        "that 4xx",
        Fate.RECORDED,
        "the transaction rolls back; the 4xx is recorded on its own and replayed",
        "new",
        logging.INFO,
    )
    TRANSACTION_FAILED = Case(
        "the app answers 2xx or 3xx although its transaction failed",
        "500 `transaction-failed`",
        Fate.RELEASED,
        _ROLLED_BACK_RELEASED,
        "released",
        logging.WARNING,
        "transaction-failed",
        500,
    )
    TRANSACTION_CONFLICT = Case(
        "the transaction hits a serialization failure or a deadlock (at commit, or in the "
        "app, uncaught)",
        "503 `transaction-conflict` + `Retry-After`",
        Fate.RELEASED,
        _ROLLED_BACK_RELEASED,
        "released",
        logging.INFO,
        "transaction-conflict",
        503,
    )
    LEASE_LOST = Case(
        "the owner outlived its lease and was taken over (transactional mode)",
        "409 `lease-lost`",
        Fate.ANOTHERS,
        "its writes rolled back; the key is the new owner's, and the retry gets its answer",
        "lease_lost",
        logging.WARNING,
        "lease-lost",
        409,
    )
    KEY_TAKEN = Case(
        "atomic mode: another server wrote the key's record first (a rolling deploy that mixes "
        "atomic and other servers on one database)",
        "409 `request-in-progress` + `Retry-After`",
        Fate.ANOTHERS,
        "its whole transaction rolled back; the key is the other writer's, and the retry gets "
        "its answer",
        "conflict",
        logging.WARNING,
        "request-in-progress",
        409,
    )
    LEASE_LOST_PLAIN = Case(
        "the owner outlived its lease and was taken over (plain mode)",
        "the app's answer, not recorded (its effect happened)",
        Fate.ANOTHERS,
        "the new owner's",
        "lease_lost",
        logging.WARNING,
    )
    NOT_RECORDED = Case(
        "plain mode: the store fails while the app's answer is recorded",
        "the app's answer (its effect happened)",
        Fate.HELD,
        "left to its lease: after it lapses, a retry runs again",
        "store_error",
        logging.ERROR,
    )
    TOO_LARGE_TO_STORE = Case(
        "the app's response is larger than `max_stored_response_bytes` (or a long stream)",
        "sent once, as the app sends it",
        Fate.RECORDED_WITHOUT_BODY,
        "recorded as completed without its body: retries get 409 "
        "`response-not-replayable` with `original_status` (or the empty replay above), and "
        "it never runs again",
        "new",
        logging.INFO,
    )

    @property
    def case(self) -> Case:
        value: Case = self.value
        return value

    @property
    def outcome(self) -> str:
        return self.case.outcome

    @property
    def level(self) -> int:
        return self.case.level


def markdown_table() -> str:
    """The table as the contract page (docs/contract.md) shows it."""
    lines = [
        "| situation | answer | the key | logged as |",
        "| --- | --- | --- | --- |",
    ]
    for settlement in Settlement:
        case = settlement.case
        logged = f"`{case.outcome}` ({logging.getLevelName(case.level)})"
        lines.append(f"| {case.situation} | {case.answer} | {case.key} | {logged} |")
    return "\n".join(lines) + "\n"
