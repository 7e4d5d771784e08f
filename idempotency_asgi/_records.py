"""The values passed between the middleware and the store, and the stored-response format."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import orjson

#: Version of the stored-response encoding written into each row. A reader refuses rows of a
#: version it does not know instead of guessing (see `Outcome.UNREADABLE`), so a deploy that
#: changes the encoding and a rollback past it never misread each other's rows.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Lease:
    """The right to run one key's request: whoever holds the current token may complete it."""

    tenant: str
    key: str
    token: int
    seconds: float
    #: the key row's ctid as its claim made it, for the completion to find it by (see
    #: _postgres/sql/recording.COMPLETE_BY_ROW); None when not known
    row: tuple[int, int] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class StoredResponse:
    status: int
    headers: Sequence[tuple[bytes, bytes]]
    #: None when the body was larger than the store keeps: the request completed, but its
    #: response cannot be replayed, and it will never run again under this key.
    body: bytes | None


class Outcome(enum.Enum):
    CLAIMED = "claimed"  # new key: the caller holds the lease and runs the request
    EXPIRED = "expired"  # the key's record was past its retention: the caller runs it as new
    TAKEN_OVER = "taken_over"  # the previous owner's lease lapsed: the caller runs it again
    COMPLETED = "completed"  # same request, finished: replay `response`
    IN_FLIGHT = "in_flight"  # same request, still running under a live lease
    MISMATCH = "mismatch"  # the key belongs to a different request
    UNREADABLE = "unreadable"  # finished, stored in a format this version cannot read
    OVER_LIMIT = "over_limit"  # new key, but the tenant has too many requests in flight
    OVER_QUOTA = "over_quota"  # new key, but the tenant already stores too many keys
    ABSENT = "absent"  # nobody holds the key (the atomic mode's first look, before it runs)


class HeldReason(str, enum.Enum):
    """Why a key is held in flight instead of running: written into its row (`held_reason`)
    by whatever holds it, and shown by `idempotency-asgi held`. A held row is in flight until
    `lease_expires_at`; nobody renews it, and only an operator (settle, release) or the lapse
    of its hold ends it."""

    #: the handler raised OutcomeUnknown: its effect may or may not have happened
    OUTCOME_UNKNOWN = "outcome-unknown"
    #: the handler committed or rolled back the request's transaction itself
    TRANSACTION_ENDED = "transaction-ended"
    #: another session waited on the request's idle transaction past
    #: `transaction_idle_seconds` (a session of the handler's own), and was cancelled
    TRANSACTION_IDLE = "transaction-idle"
    #: plain mode: the answer was sent, but its record could not be written
    NOT_RECORDED = "not-recorded"
    #: never stored: what `held` says of a key in flight past its lease with no reason (its
    #: owner died, or stalled), which a retry may take over
    LEASE_LAPSED = "lease-lapsed"


@dataclass(frozen=True)
class HeldKey:
    """A key held in flight for an operator to settle or release (see `PostgresStore.held`)."""

    tenant: str
    key: str
    method: str
    path: str
    #: when its request was claimed
    since: datetime
    #: why it is held: a `HeldReason` value
    reason: str
    #: until when it is held; a retry after that runs the request again
    until: datetime


@dataclass(frozen=True)
class Reconciled:
    """What an operator's settle or release did to a key."""

    tenant: str
    key: str
    #: what the key was: a `HeldReason` value, or "completed"
    previous: str
    #: "completed" (settled) or "released"
    state: str
    #: settled: until when the answer is replayed; released: None
    expires_at: datetime | None = None


#: Sent with every recorded response and its replays: until when the key is honoured. Not
#: stored with the response (it is derived from the record), so replays stay byte-identical.
EXPIRES_HEADER = b"idempotency-key-expires"


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def expiry_header(expires_at: datetime) -> tuple[bytes, bytes]:
    """The header, as an IMF-fixdate (RFC 9110), e.g. `Sun, 22 Nov 2026 08:49:37 GMT`: to the
    second, as the format says (a fraction is dropped)."""
    return _expiry_header(math.floor(expires_at.timestamp()))


def expiry_header_at(seconds: int) -> tuple[bytes, bytes]:
    """The same header for an expiry given in whole seconds since the epoch."""
    return _expiry_header(seconds)


# Keyed by the second: the new keys of one second share their date (a record's own instant,
# to the microsecond, never repeats), and a hot key is replayed with the same date many times.
@functools.lru_cache(maxsize=4096)
def _expiry_header(seconds: int) -> tuple[bytes, bytes]:
    t = datetime.fromtimestamp(seconds, timezone.utc)
    value = (
        f"{_DAYS[t.weekday()]}, {t.day:02d} {_MONTHS[t.month - 1]} {t.year:04d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d} GMT"
    )
    return EXPIRES_HEADER, value.encode("ascii")


def encode_headers(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    # Header bytes map one to one onto latin-1 code points, so the round trip is lossless.
    return orjson.dumps(
        [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]
    )


def decode_headers(data: bytes) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in orjson.loads(data)]
